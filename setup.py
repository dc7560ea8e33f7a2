from setuptools import find_packages, setup

setup(
    name="cppo-kernels",
    version="0.1.0",
    description="Fused Triton kernels and a thin trainer for CPPO (Completion Pruning Policy Optimization)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["cppo_kernels", "cppo_kernels.*", "cppo", "cppo.*"]),
    package_data={"cppo": ["presets/*.yaml"]},
    install_requires=[
        "torch>=2.4",
        "triton>=3.2; platform_system == 'Linux'",
        "numpy",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-xdist",
            "hypothesis>=6.100",
            "liger-kernel>=0.6",
            "ruff",
            "tensorboard",
            "wandb",
            "trl>=1.16,<1.17",
            "peft",
        ],
        "train": ["transformers>=4.46", "accelerate", "gguf", "math-verify", "tqdm", "pyyaml", "peft>=0.15"],
        "bench": ["matplotlib", "scipy"],  # scipy: the t tests of the accuracy sweeps (benchmarks/sweeps/report.py)
        "report": ["tensorboard", "wandb"],  # report_to: tensorboard, wandb (imported only when named)
        "hub": ["datasets"],
        "trl": ["trl>=1.16,<1.17", "peft"],  # cppo.trl: the drop-in for TRL's GRPOTrainer
        "vllm": ["vllm"],
        "flash": ["flash-attn"],
    },
    entry_points={"console_scripts": ["cppo=cppo.cli:main"]},
)
