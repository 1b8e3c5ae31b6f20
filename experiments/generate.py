"""Samples text from a trained run of experiments/language_model.py.

    python experiments/generate.py --run_dir runs/ptb --num_tokens 50               # from <eos>
    python experiments/generate.py --run_dir runs/ptb --num_tokens 50 --prompt "the company said" \\
        --temperature 0.8 --top_p 0.95 --num_samples 3 --seed 1

The model is rebuilt as the run built it: its config.json goes through language_model.py's own
``Config`` and ``build_model`` (either model family: AWD-LSTM or Transformer, any head), the
vocabulary is the run's vocab.txt, and the run's best parameters (``best_params`` of its latest
checkpoint) are loaded into it. Sampling is :func:`bottleneck.generate`: incremental decoding
(the AWD-LSTM's recurrent state, the Transformer's key-value cache) with temperature, top-k
(``--top_k 1``: greedy) and top-p, then optionally basis-aware truncation (``--bat_tau TAU``,
a softmax head's run only). A Transformer's prompt and samples together may not exceed
its ``max_len``.

The prompt is split on white space; every word must be in the run's vocabulary (PTB text is
lower case, numbers are ``N``, rare words ``<unk>``), otherwise the script names the missing
words and exits with status 2. Without a prompt the samples start a new sentence (they are
conditioned on ``<eos>``).

Output: the samples, each prompt followed by its continuation with ``<eos>`` shown as a line
break, on stdout and in RUN/samples/<UTC time>_seed<S>.txt (a header line with the settings, then
the samples). Nothing else in the run folder changes, except that a run without vocab.txt (made
before the run loop wrote it) reads its corpus again as language_model.py did, preparing it
under RUN/tfds if that was deleted.
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Annotated

import jax
import numpy as np

import bottleneck as bn
from bottleneck.data import EOS, Vocabulary
from bottleneck.runs import UsageError, parse_config
from bottleneck.runs.cli import Checked, Count, Interval, Positive, one_line_errors
from bottleneck.runs.folder import to_jsonable
from bottleneck.runs.language_model import load_run


@dataclasses.dataclass(frozen=True)
class Config(Checked):
    """Sample text from a trained language_model.py run."""

    run_dir: str  # the --out_dir of a language_model.py run
    num_tokens: Count = 50  # tokens to sample
    temperature: Positive = 1.0  # greedy: --top_k 1
    top_k: Count | None = None  # keep the k most likely tokens (1: greedy); None: all
    top_p: Annotated[float, Interval("(0, 1]")] | None = None  # nucleus sampling; None: off
    # basis-aware truncation at this threshold (Finlayson et al. 2024); softmax heads only
    bat_tau: Annotated[float, Interval("(0, 1)")] | None = None
    prompt: str = ""  # words to continue; empty: start a sentence
    num_samples: Count = 1  # samples of the prompt
    seed: int = 0


def encode_prompt(prompt: str, vocabulary: Vocabulary) -> list[str]:
    """The prompt's words (``[<eos>]`` for an empty prompt); unknown words are a UsageError."""
    words = prompt.split() or [EOS]
    unknown = list(dict.fromkeys(word for word in words if word not in vocabulary))
    if unknown:
        raise UsageError(
            f"--prompt has {len(unknown)} word(s) not in the run's vocabulary of "
            f"{len(vocabulary)}: {', '.join(map(repr, unknown))} (PTB-style text is lower case, "
            "numbers are N, rare words <unk>)"
        )
    return words


def detokenize(tokens: list[str]) -> str:
    """Tokens joined by spaces, each ``<eos>`` ending a line."""
    lines, line = [], []
    for token in tokens:
        if token == EOS:
            lines.append(" ".join(line))
            line = []
        else:
            line.append(token)
    return "\n".join([*lines, " ".join(line)]).strip("\n")


def write_samples(root: Path, config: Config, texts: list[str]) -> Path:
    """``root/samples/<UTC time>_seed<S>.txt``: a JSON header line, then the samples."""
    folder = root / "samples"
    folder.mkdir(exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = folder / f"{stamp}_seed{config.seed}.txt"
    copy = 1
    while path.exists():  # two runs in one second
        path = folder / f"{stamp}_seed{config.seed}-{copy}.txt"
        copy += 1
    body = "".join(f"== sample {i + 1} ==\n{text}\n" for i, text in enumerate(texts))
    path.write_text(f"# {json.dumps(to_jsonable(config))}\n{body}")
    return path


def run(config: Config) -> list[str]:
    """Loads the run, samples ``num_samples`` continuations, prints and writes them."""
    _, vocabulary, model = load_run(config.run_dir)
    words = encode_prompt(config.prompt, vocabulary)
    # A Transformer's key-value cache holds the prompt and every sampled token but the last.
    max_len = getattr(model, "max_len", None)
    if max_len is not None and len(words) + config.num_tokens - 1 > max_len:
        raise UsageError(
            f"a prompt of {len(words)} token(s) and --num_tokens {config.num_tokens} need "
            f"{len(words) + config.num_tokens - 1} positions; the run's Transformer takes "
            f"max_len {max_len}"
        )
    prompt = np.tile(vocabulary.encode(words), (config.num_samples, 1))
    try:
        tokens = bn.generate(
            model,
            prompt,
            config.num_tokens,
            key=jax.random.key(config.seed),
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            bat_tau=config.bat_tau,
        )
    except ValueError as err:  # e.g. top_k above the vocabulary, BAT on a mixture head
        raise UsageError(str(err)) from None
    shown = words if config.prompt.split() else []
    texts = [detokenize(shown + vocabulary.decode(row)) for row in np.asarray(tokens)]
    for i, text in enumerate(texts):
        print(f"== sample {i + 1} ==\n{text}")
    path = write_samples(Path(config.run_dir), config, texts)
    print(f"\nwrote {path}")
    return texts


def main(argv: list[str] | None = None) -> list[str]:
    config = parse_config(Config, argv=argv)
    with one_line_errors(config):
        return run(config)


if __name__ == "__main__":
    main(sys.argv[1:])
