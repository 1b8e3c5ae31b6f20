"""Word-level language modelling on PTB / WikiText-2: AWD-LSTM or Transformer, any output head.

``model:awd_lstm`` (the default) is the recipe of Merity et al. (2017) as used by Kanai et al.
(2018, App. C.1) and Ganea et al. (2019): a 3-layer AWD-LSTM (weight drop, locked / embedding
dropout, tied embeddings, AR/TAR), SGD with per-batch learning rate ``lr * seq_len / bptt``,
gradient clipping, weight decay and NT-ASGD. ``model:transformer`` is a GPT-2-style decoder
(:class:`bottleneck.nn.Transformer`: pre-norm, RoPE, tied embeddings) trained with AdamW, linear
warmup and cosine decay (``--optimizer adamw``), keeping the best validated model; start from
its presets (``transformer-smoke``, ``transformer-cpu``, ``transformer-gpu``). Either model
takes any head (``--head``) of bottleneck.nn.HEAD_NAMES: softmax, sigsoftmax, the sigmoid /
ReLU normalizers, PLIF, the monotone MLP, MoS (Yang et al. 2018), MoSS, MoS + PLIF.

    python experiments/language_model.py smoke --out_dir /tmp/lm           # seconds
    python experiments/language_model.py transformer-cpu --head mos --data_dir PTB_DIR
    python experiments/language_model.py cpu-small --data_dir PTB_DIR
    python experiments/language_model.py paper-ptb --head sigsoftmax --out_dir runs/ptb
    python experiments/language_model.py paper-ptb --head sigsoftmax \\
        --finetune_from runs/ptb --out_dir runs/ptb-finetune             # Merity's finetune
    python experiments/language_model.py mos-ptb --lr 25 --finetune_from runs/mos \\
        --out_dir runs/mos-finetune --dynamic_eval                       # Yang's recipe

The config, presets and run are :mod:`bottleneck.runs.language_model`'s. Flags come in groups, one
per part of :class:`Config` (``--data.*``, ``--model.*``, ``--head.*``, ``--optimizer.*``,
``--training.*``, ``--evaluation.*``), each also under its own name (``--lr`` is
``--optimizer.lr``) where that is unique (``tie_weights`` is not: ``--model.tie_weights``); the
model is a choice, ``model:awd_lstm`` or ``model:transformer`` (a preset chooses it; ``--model.*``
are the chosen model's fields), and ``--help`` lists the flags and what each preset sets. Both
models see the same data: the AWD-LSTM's variable-length training windows (for the stateless
Transformer, window boundaries that move every epoch vary the context each token is trained with;
``--max_len`` must cover the longest, and each step is scaled by ``seq_len / bptt`` for AdamW as
for SGD) and the same evaluation windows. The run (epochs, NT-ASGD, ``--finetune_from``'s averaging
stage, ``--patience``, checkpoints every epoch and on SIGINT / SIGTERM, resuming by rerunning the
same command, the final and ``--dynamic_eval`` evaluation, the files written to ``--out_dir``) is
:mod:`bottleneck.runs.run_loop`'s; its docstring says what it does. A resumed run may change only
the fields in ``RESUMABLE_CHANGES`` (for AdamW not ``--epochs``, which sets its schedule's length).

``--mesh data=4,vocab=2`` (default: every device on ``data``) shards the batch (``--batch_size``
must divide) and splits the head's decoder, the tied embedding and the normalizers over
``vocab`` (:mod:`bottleneck.sharding`); results equal one device's to float32 round-off
(tests/test_sharding.py). The script runs in one process; a multi-host run would need
:func:`bottleneck.sharding.initialize_distributed` and an output folder that every host can
write (checkpoints are written by Orbax, each host its own shards), which nothing tests yet.
A checkpoint that cannot be written (a full disk) stops the run with a one-line error and exit
status 2, its partial folder deleted; rerunning the command resumes from the last complete one.
"""

from __future__ import annotations

import softmax_bottleneck  # noqa: F401  # isort: skip  (first: checks that `bottleneck` is ours)
import sys
from typing import Any

from bottleneck.runs import parse_config
from bottleneck.runs.cli import one_line_errors
from bottleneck.runs.language_model import PRESETS, Config, run_experiment
from bottleneck.runs.run_loop import TrainingDiverged


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_config(Config, PRESETS, argv)
    with one_line_errors(config, {TrainingDiverged: 1}):
        return run_experiment(config)


if __name__ == "__main__":
    main(sys.argv[1:])
