"""Make plans/data/gpt_train.bin and gpt_val.bin, the token streams of plans/gpt.yaml.

The text is generated: a character Markov chain of order 4 learnt from plans/data/tiny.txt
(a short story written for this project) walks 165,000 characters that read like it.
Each character becomes its index in the story's sorted alphabet (54 characters) and the
streams are written as raw uint16 values, as nanoGPT's data/shakespeare_char/prepare.py
writes train.bin and val.bin: the first 90% train, the rest validation. The output is the
same for a given seed on every machine (Python's `random` only).

    python plans/data/make_tokens.py                 # rewrites plans/data/gpt_*.bin
    python plans/data/make_tokens.py --chars 1000000 --seed 1 -o /tmp/tokens
"""

from __future__ import annotations

import argparse
import random
from array import array
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = 4


def alphabet(text: str) -> str:
    return "".join(sorted(set(text)))


def generate(text: str, chars: int, seed: int) -> str:
    """`chars` characters of an order-4 Markov chain over `text` (restarting at its start
    when a context has no continuation)."""
    follows: dict[str, list[str]] = defaultdict(list)
    for i in range(len(text) - ORDER):
        follows[text[i:i + ORDER]].append(text[i + ORDER])
    rng = random.Random(seed)
    out = list(text[:ORDER])
    while len(out) < chars:
        options = follows.get("".join(out[-ORDER:]))
        out.append(rng.choice(options) if options else text[len(out) % ORDER])
    return "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=165_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("-o", "--out", type=Path, default=HERE, help="directory of gpt_train.bin, gpt_val.bin")
    args = parser.parse_args()
    story = (HERE / "tiny.txt").read_text()
    index = {c: i for i, c in enumerate(alphabet(story))}
    tokens = array("H", (index[c] for c in generate(story, args.chars, args.seed)))
    if array("H", [1]).tobytes() != b"\x01\x00":
        tokens.byteswap()  # little-endian on every machine, as numpy's uint16 reads it
    split = len(tokens) * 9 // 10
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpt_train.bin").write_bytes(tokens[:split].tobytes())
    (args.out / "gpt_val.bin").write_bytes(tokens[split:].tobytes())
    print(f"{split} train and {len(tokens) - split} validation tokens, vocabulary {len(index)}, in {args.out}")


if __name__ == "__main__":
    main()
