from setuptools import find_packages, setup

EXTRAS = {
    "nn": ["flax"],
    "train": ["optax", "orbax-checkpoint", "grain", "absl-py", "ml_collections", "tokenizers", "tensorboardX",
              "tqdm", "matplotlib"],
    "test": ["pytest", "pytest-xdist", "hypothesis", "chex", "nbclient", "nbformat", "ipykernel"],
}
EXTRAS["all"] = sorted({dep for deps in EXTRAS.values() for dep in deps})

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
