import os

from setuptools import find_packages, setup

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
    package_data={"mindspeed_tp": ["configs/*.yaml", "configs/*/*.yaml"]},
    python_requires=">=3.9",
    # torch is the user's own (CUDA build, CPU build, or torch_npu's): any 2.x is accepted.
    install_requires=["torch>=2.1", "numpy", "pyyaml", "safetensors", "packaging"],
    extras_require={
        "megatron": ["megatron-core>=0.12,<0.17"],
        "test": ["pytest>=7"],
        "hf": ["transformers>=4.51"],
        "npu": ["torch_npu"],
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["mindspeed-tp=mindspeed_tp.cli:main"]},
)
