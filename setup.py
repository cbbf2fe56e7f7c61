from setuptools import find_packages, setup

EXTRAS = {
    "nn": ["flax"],
    "train": ["optax", "orbax-checkpoint", "grain", "absl-py", "ml_collections", "tokenizers", "tensorboardX",
              "tqdm", "matplotlib"],
    # FLA / Hugging Face checkpoints in and out (`osdn_jax.convert`): safetensors' numpy API, no torch.
    "convert": ["safetensors"],
    "test": ["pytest", "pytest-xdist", "hypothesis", "chex", "nbclient", "nbformat", "ipykernel"],
}
EXTRAS["all"] = sorted({dep for deps in EXTRAS.values() for dep in deps})
# The input formats and tokenizers of `python -m osdn_jax.data.prepare` beyond .txt/.jsonl/.jsonl.gz, bytes, BPE
# and tokenizer.json: .jsonl.zst, .parquet, sentencepiece .model. Not in "all" (pyarrow is large).
EXTRAS["corpora"] = ["zstandard", "pyarrow", "sentencepiece"]
# lm-evaluation-harness, for `osdn_jax.harness.lm_class` (the adapter itself needs none of it). Not in "all": it
# brings datasets and its stack.
EXTRAS["eval"] = ["lm_eval"]
# libtpu at the version the installed jax pins, for compiling TPU programs on a Linux x86-64 host without a TPU
# (osdn_jax.train.aot; its wheels exist for that platform only). Not in "all": with libtpu installed, JAX probes
# for a TPU at start-up on every machine whose JAX_PLATFORMS does not rule it out.
EXTRAS["tpu-aot"] = ["jax[tpu]; platform_system == 'Linux' and platform_machine == 'x86_64'"]

setup(
    name="osdn-jax",
    version="0.1.0",
    description="Curvature-aware (preconditioned) delta-rule linear attention in JAX and Pallas",
    packages=find_packages(include=["osdn_jax", "osdn_jax.*", "pallas_kernels", "pallas_kernels.*",
                                    "experiments", "experiments.*", "benchmarks", "benchmarks.*"]),
    python_requires=">=3.11",
    install_requires=["jax>=0.10.2", "numpy"],
    extras_require=EXTRAS,
)
