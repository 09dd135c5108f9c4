"""spade-mega: SPADE self-play for Megatron-scale MoE models. Metadata only; see README.md."""

from setuptools import find_packages, setup

setup(
    name="spade-mega",
    version="0.1.0",
    description="SPADE self-play (LLM-designed executable environments, hint-based regret) on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The top-level folder kernels/ is the subpackage spade_mega.kernels: a top-level `kernels` import name
    # would collide with another widely used package.
    packages=find_packages(include=["spade_mega", "spade_mega.*"]) + ["spade_mega.kernels"],
    package_dir={"spade_mega.kernels": "kernels"},
    package_data={"spade_mega": ["py.typed", "envs/library/programs/*.py", "envs/environments.md"]},  # read as text: library programs, the contract
    install_requires=[
        "torch>=2.6",
        # 0.19.2 (what constraints/cpu.txt pins) needs --ignore-requires-python on 3.11; a plain install on 3.11
        # resolves to 0.16.1, which spade-mega also imports with.
        "megatron-core>=0.16.1,<0.20",
        "triton>=3.3; platform_system == 'Linux'",
        "numpy",
        "pyyaml",
        "gymnasium>=1.0",
        "transformers>=4.51",
        "safetensors",
        "msgpack",
        "tensorboard",
        "matplotlib",
        "rich",
        "nvidia-ml-py",
        "pyarrow",  # corpus loading: Parquet and Hugging Face datasets saved to disk
        "psutil",  # megatron-core dist_checkpointing save workers need it (an optional import there)
        "sympy",  # held-out maths answers compared symbolically (evaluation/symbolic.py)
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "wandb"],
        # tools/bench kernels' Liger baseline (its CPU correctness check runs Liger's kernel under the interpreter)
        "bench": ["liger-kernel"],
        "gpu": ["transformer-engine[pytorch]"],
        "sglang": ["sglang"],
        "vllm": ["vllm"],
        "wandb": ["wandb>=0.31"],  # logging.wandb: Weights & Biases (the tests write offline runs with it)
    },
    entry_points={"console_scripts": ["spade-mega=spade_mega.cli:main"]},
)
