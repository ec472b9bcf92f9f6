"""Generate a tiny random-weight Mixtral-style MoE model that vLLM can serve.

Runs in the vLLM venv (see setup_env.sh), not the project venv. Deterministic: the
same seed gives the same tokenizer and the same weights.

    python make_tiny_moe.py OUT_DIR [--seed 0] [--dtype bfloat16|float32]

Model: 2 layers, hidden 128, 4 experts, top-2, a 4,096-token byte-level BPE vocabulary
trained on generated English-ish text, and a ChatML chat template with eos <|im_end|>.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

COMMON_TEXT = (
    "the a an of to and in is it you that he she was for on are with as they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how said "
    "each which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my over "
    "know water than call first who may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line differ turn cause much mean "
    "before move right boy old too same tell does set three want air well also play small end put "
    "home read hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross farm "
    "hard start might story saw far sea draw left late run while press close night real life few "
    "north book carry took science eat room friend began idea fish mountain stop once base hear "
    "horse cut sure watch color face wood main open seem together next white children begin got walk "
    "example ease paper group always music those both mark often letter until mile river car feet "
    "care second enough plain girl usual young ready above ever red list though feel talk bird soon "
    "body dog family direct pose leave song measure door product black short numeral class wind "
    "question happen complete ship area half rock order fire south problem piece told knew pass "
    "since top whole king space heard best hour better true during hundred five remember step early "
    "hold west ground interest reach fast verb sing listen six table travel less morning ten simple "
    "several vowel toward war lay against pattern slow center love person money serve appear road "
    "map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark "
    "machine note wait plan figure star box noun field rest correct able pound done beauty drive "
    "assistant careful online bookshop customer order shipping price library novel author chapter"
)
ONSETS = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "st", "tr"]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
CODAS = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "ck"]


def make_corpus(rng: random.Random, n_sentences: int = 40_000) -> list[str]:
    """English-ish sentences: common words mixed with invented, pronounceable ones."""
    common = COMMON_TEXT.split()
    invented = [
        "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.randint(1, 3)))
        for _ in range(6_000)
    ]
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(common) if rng.random() < 0.7 else rng.choice(invented) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        sentence = " ".join(words) + rng.choice([".", ".", ".", "?", "!", ",", ";"])
        if rng.random() < 0.1:
            sentence += f" {rng.randint(0, 9999)}"
        lines.append(sentence)
    return lines


def train_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype) -> MixtralForCausalLM:
    config = MixtralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = MixtralForCausalLM(config)  # random init from the global torch seed
    return model.to(dtype).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    tokenizer = train_tokenizer(make_corpus(rng))
    model = build_model(tokenizer, getattr(torch, args.dtype))

    # Write into a temporary sibling and rename, so a half-written model never looks complete.
    out: Path = args.out_dir.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    n_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"out": str(out), "params": n_params, "vocab": len(tokenizer), "dtype": args.dtype}))


if __name__ == "__main__":
    main()
