"""A deterministic tiny Llama checkpoint built offline, plus S3 upload helpers.

There is no model hub here, so tests build their own model: a ~202k-parameter
Llama (hidden 64, 2 heads / 1 KV head -> head_dim 32, which vLLM's CPU attention
supports; head_dim 16 does not), float32, untied embeddings, with a BPE
tokenizer trained locally. Weights come from ``torch.manual_seed(0)`` so every
build is byte-identical and greedy outputs are comparable across runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "EXTRA_FILE",
    "build_tiny_model",
    "copy_nonweight_files",
    "nonweight_files",
    "upload_dir",
    "weight_files",
]

#: A non-weight file in a sub-folder, to check that folder structure survives.
EXTRA_FILE = "extra/notes.txt"

_BUILD_VERSION = 3  # bump to invalidate cached builds when the recipe changes
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Ray Data runs batch inference with vLLM.",
    "Run:ai Model Streamer streams safetensors from S3.",
    "Hello world, this is a tiny llama model for tests.",
    "What is the capital of France? Paris is the capital.",
]
#: (question, answer) pairs the model is trained on for a few seconds, so that a demo's
#: output is recognisable. The system prompt is the one in the ray#55574 script.
SYSTEM = "You are a bot that responds with haikus."
ANSWERS = {
    "What is the capital of France?": "Paris is the capital.",
    "Start of the haiku is: Complete this for me...": "Weights flow from the bucket, no copy on the disk.",
}
_CORPUS = (_SENTENCES + [f"system: {SYSTEM} user: {q} assistant: {a}" for q, a in ANSWERS.items()]) * 20
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _marker(out: Path) -> Path:
    # Kept OUTSIDE the model dir so uploads and listings never see it.
    return out.with_suffix(".done")


#: How the tokenizer files are laid out (the weights are the same in every layout).
#: "embedded": tokenizer.json, and the chat template also inside tokenizer_config.json
#:   (the pre-4.4x layout, which Ray's tokenizer-only download happens to keep);
#: "jinja": the chat template only in chat_template.jinja (how transformers saves it today);
#: "bpe-files": GPT-2 style vocab.json + merges.txt (no tokenizer.json), template in the .jinja.
LAYOUTS = ("embedded", "jinja", "bpe-files")


def _build_spec(shards: int, layout: str = "embedded") -> dict[str, Any]:
    spec: dict[str, Any] = {"version": _BUILD_VERSION, "shards": shards}
    if layout != "embedded":
        spec["layout"] = layout
    return spec


def build_tiny_model(out: Path, shards: int = 1, layout: str = "embedded") -> Path:
    """Build (or reuse a cached build of) the tiny model in ``out`` and return ``out``.

    ``shards=1`` writes ``model.safetensors``; ``shards=2`` writes exactly
    ``model-0000{1,2}-of-00002.safetensors`` plus ``model.safetensors.index.json``.
    A build is reused only if ``out.with_suffix('.done')`` records the same spec;
    the marker is written last, and the dir is built elsewhere then renamed in.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}")
    if shards not in (1, 2):
        raise ValueError("shards must be 1 or 2")
    out = Path(out)
    marker = _marker(out)
    spec = _build_spec(shards, layout)
    if out.is_dir() and marker.is_file():
        try:
            if json.loads(marker.read_text()) == spec:
                return out
        except ValueError:
            pass
    marker.unlink(missing_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _build_into(tmp, shards, layout)
    tmp.rename(out)
    marker.write_text(json.dumps(spec))
    return out


def _build_into(out: Path, shards: int, layout: str = "embedded") -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" noise in test output
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _CORPUS,
        trainers.BpeTrainer(
            vocab_size=1000,
            min_frequency=1,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    # transformers 5 writes tokenizer_class "TokenizersBackend", which v4 cannot load;
    # the v4 name still maps to the same class in v5. Also cap the absurd max length.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["model_max_length"] = 256
    # transformers 5 keeps the template only in chat_template.jinja, but Ray 2.48's
    # TOKENIZER_ONLY download keeps just "*tokenizer*" / "*config.json" names, so its
    # chat-template stage would see no template. Embed it too (the pre-4.4x layout).
    if layout == "embedded":
        tc["chat_template"] = _CHAT_TEMPLATE
    else:
        tc.pop("chat_template", None)
        (out / "chat_template.jinja").write_text(_CHAT_TEMPLATE)
    if layout == "bpe-files":
        # GPT-2 style files only: the same trained BPE as vocab.json + merges.txt.
        tok.model.save(str(out))
        (out / "tokenizer.json").unlink()
        tc["tokenizer_class"] = "GPT2Tokenizer"
        tc["add_prefix_space"] = False
        tc["add_bos_token"] = False
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,  # head_dim 32
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        _train(model, fast)
    # The float32 checkpoint is ~810 KB: 500KB splits it into exactly two shards.
    kwargs: dict[str, Any] = {"max_shard_size": "500KB"} if shards == 2 else {}
    model.save_pretrained(out, **kwargs)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2, max_new_tokens=16).save_pretrained(out)

    extra = out / EXTRA_FILE
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_text("A non-weight file in a sub-folder of the tiny test model.\n")

    got = weight_files(out)
    want = (
        ["model.safetensors"]
        if shards == 1
        else ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    if got != want:
        raise RuntimeError(f"tiny model: expected weight files {want}, got {got}")
    if shards == 2 and not (out / "model.safetensors.index.json").is_file():
        raise RuntimeError("tiny model: sharded build has no model.safetensors.index.json")


def _train(model: Any, tokenizer: Any, steps: int = 120) -> None:
    """A few seconds of training so the tiny model repeats what it saw (deterministic on CPU)."""
    import torch

    texts = list(_SENTENCES)
    for question, answer in ANSWERS.items():
        for messages in ([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                         [{"role": "user", "content": question}]):
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            texts.append(f"{prompt} {answer}")
    batch = [tokenizer(t)["input_ids"] + [2] for t in texts]  # 2 = </s>
    width = max(map(len, batch))
    ids = torch.tensor([b + [2] * (width - len(b)) for b in batch])
    labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(steps):
            opt.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
        model.eval()
    finally:
        torch.set_num_threads(threads)


def _files(local: Path) -> list[str]:
    local = Path(local)
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())


def weight_files(local: Path) -> list[str]:
    """Sorted relative POSIX paths of the weight files (``*.safetensors``) under ``local``."""
    return [f for f in _files(local) if f.endswith(".safetensors")]


def nonweight_files(local: Path) -> list[str]:
    """Sorted relative POSIX paths of every other file under ``local`` (configs, tokenizer, extras)."""
    return [f for f in _files(local) if not f.endswith(".safetensors")]


def copy_nonweight_files(src: Path, dst: Path) -> Path:
    """Copy only the non-weight files of ``src`` into ``dst`` (a config/tokenizer-only dir)."""
    src, dst = Path(src), Path(dst)
    for rel in nonweight_files(src):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, target)
    return dst


def upload_dir(s3_client: Any, local: Path, bucket: str, prefix: str) -> dict[str, int]:
    """Upload every file under ``local`` to ``s3://bucket/prefix/<rel>``.

    Creates the bucket if missing. Returns ``{relative path: size in bytes}``.
    """
    from botocore.exceptions import ClientError

    local = Path(local)
    try:
        s3_client.head_bucket(Bucket=bucket)
    except ClientError:
        s3_client.create_bucket(Bucket=bucket)
    prefix = prefix.strip("/")
    uploaded: dict[str, int] = {}
    for rel in _files(local):
        key = f"{prefix}/{rel}" if prefix else rel
        s3_client.upload_file(str(local / rel), bucket, key)
        uploaded[rel] = (local / rel).stat().st_size
    return uploaded


REMOTE_CODE_ARCH = "RrsTinyForCausalLM"
REMOTE_CODE_FILE = "modeling_rrs_tiny.py"


def remote_code_variant(src: Path, out: Path) -> Path:
    """*src* as a custom-code checkpoint: ``auto_map`` names a class in a ``.py`` file of the model.

    vLLM does not know the architecture, so every process that resolves the model class --
    the engine, and each worker on each node -- imports that file from ``model_config.model``
    (Transformers backend). The class is the tiny Llama itself, so the weights and the
    output are the same.
    """
    src, out = Path(src), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [REMOTE_CODE_ARCH]
    config["auto_map"] = {"AutoModelForCausalLM": f"{REMOTE_CODE_FILE[:-3]}.{REMOTE_CODE_ARCH}"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / REMOTE_CODE_FILE).write_text(
        "from transformers import LlamaForCausalLM\n\n\n"
        f"class {REMOTE_CODE_ARCH}(LlamaForCausalLM):\n"
        "    \"\"\"A custom-code checkpoint's model class (the tiny Llama itself).\"\"\"\n"
    )
    return out
