"""Hugging Face checkpoint files with `safetensors`' numpy API (no torch): one model.safetensors, or shards listed by
model.safetensors.index.json ({"weight_map": {tensor name: file}}).

bf16 tensors read as `ml_dtypes.bfloat16` arrays (numpy has no bf16 of its own; ml_dtypes comes with jax).
"""
from __future__ import annotations

import json
import pathlib

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" name, which safetensors.numpy reads and writes)
import numpy as np

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _numpy_api():
  try:
    import safetensors.numpy as st
  except ImportError as e:
    raise ImportError("osdn_jax.convert needs the `safetensors` package (pip install safetensors, or the "
                      "project's `.[convert]` extra)") from e
  return st


def read_tensors(directory) -> dict[str, np.ndarray]:
  """{name: array} of every tensor of the checkpoint in `directory` (sharded through INDEX, or one SINGLE file, or
  every *.safetensors file). FileNotFoundError when it holds none (naming a PyTorch .bin checkpoint if it holds
  one); ValueError for a tensor listed twice, or an index naming a tensor its shard lacks."""
  st = _numpy_api()
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(f"convert: {directory} is not a directory (an FLA / Hugging Face checkpoint: config.json "
                            "and *.safetensors)")
  index = directory / INDEX
  if index.is_file():
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ValueError(f"convert: {index} holds no `weight_map` {{tensor: file}}")
    files = sorted(set(weight_map.values()))
  elif (directory / SINGLE).is_file():
    weight_map, files = None, [SINGLE]
  else:
    weight_map, files = None, sorted(p.name for p in directory.glob("*.safetensors"))
  if not files:
    bins = sorted(p.name for p in directory.glob("*.bin"))
    hint = (f"; it holds {', '.join(bins)} (PyTorch pickles): save the model with save_pretrained(..., "
            "safe_serialization=True) to write safetensors") if bins else ""
    raise FileNotFoundError(f"convert: no *.safetensors file in {directory}{hint}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    for key, value in st.load_file(str(directory / name)).items():
      if key in tensors:
        raise ValueError(f"convert: tensor {key!r} appears in two files of {directory}")
      tensors[key] = value
  if weight_map is not None:
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
      raise ValueError(f"convert: {INDEX} lists tensor {missing[0]!r} ({len(missing)} in all), which its shard "
                       f"{weight_map[missing[0]]} does not hold")
  return tensors


def write_tensors(directory, tensors: dict[str, np.ndarray], *, max_shard_bytes: int | None = None) -> list[str]:
  """Writes `tensors` into `directory` as Hugging Face does: one SINGLE file, or shards
  model-0000i-of-0000n.safetensors of at most max_shard_bytes each (a larger tensor alone in its shard) with INDEX.
  Metadata {"format": "pt"} (what transformers' from_pretrained expects). Returns the files written."""
  st = _numpy_api()
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  names = sorted(tensors)
  groups: list[list[str]] = [[]]
  size = 0
  for name in names:
    n = int(tensors[name].nbytes)
    if max_shard_bytes is not None and groups[-1] and size + n > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += n
  contiguous = lambda group: {n: np.ascontiguousarray(tensors[n]) for n in group}
  if len(groups) == 1:
    st.save_file(contiguous(groups[0]), str(directory / SINGLE), metadata={"format": "pt"})
    return [SINGLE]
  files, weight_map = [], {}
  for i, group in enumerate(groups, 1):
    file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
    st.save_file(contiguous(group), str(directory / file), metadata={"format": "pt"})
    files.append(file)
    weight_map.update({n: file for n in group})
  total = sum(int(t.nbytes) for t in tensors.values())
  (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                            indent=2, sort_keys=True) + "\n")
  return files + [INDEX]
