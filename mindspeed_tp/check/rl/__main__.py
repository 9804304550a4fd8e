from ..main import exit_worker
from .main import main

if __name__ == "__main__":  # vLLM (--engine vllm) spawns processes that import this module again
    exit_worker(main())
