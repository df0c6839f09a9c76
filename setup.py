from setuptools import find_packages, setup

setup(
    name="restkv",
    version="0.1.0",
    description="KV-cache eviction at prefill (ReST-KV and baselines) for transformers models",
    packages=find_packages(include=["restkv", "restkv.*", "visualization"]),
    package_data={"restkv.vllm": ["targets.json"]},  # the wrapped sources' digests (restkv.vllm.audit)
    python_requires=">=3.10",
    install_requires=[line.strip() for line in open("requirements.txt") if line.strip() and not line.startswith("#")],
    extras_require={
        "flash": ["flash-attn>=2.5"],
        "bench": ["matplotlib", "rouge", "rouge-score", "jieba", "fuzzywuzzy", "wonderwords", "nbclient", "nbformat", "ipykernel",
                  "datasets"],
        "test": ["pytest", "pdoc"],
        "quant": ["hqq", "optimum-quanto"],
    },
)
