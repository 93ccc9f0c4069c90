"""Supervised fine-tuning (objective: sft): next-token cross-entropy on the targets.

Its data are text, instruction and chat records, tokenized into examples with their targets and
packed several to a row (`data.pack`) or one a row (`data/records.py` `prepare_dataset`). Its
step is the chunked cross-entropy (`step/loss.py`), with no objective of its own; nothing is set
up before training, no metric is reported beyond the loss, and the plan has no term of its own.
"""

from __future__ import annotations

from featherweight.data.records import prepare_dataset
from featherweight.recipe.objectives.base import RunObjective

SFT = RunObjective("sft", prepare_dataset=prepare_dataset)
