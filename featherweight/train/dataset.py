"""A run's data from its config: the prepared dataset, `epochs` as steps, and the data summary.

The summary says what the data became before the first step (and in `data_summary.json`):
records read and skipped (with reasons), the train/eval split, tokens, rows, truncated examples,
packing efficiency, and how many epochs the run's steps make.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from featherweight.data.chat_templates import with_chat_template
from featherweight.data.packing import PackStats
from featherweight.data.preference import PairStats
from featherweight.data.records import Dataset
from featherweight.io.atomic import atomic_write_text
from featherweight.io.tokenizer import Tokenizer
from featherweight.recipe.build import packed_slots
from featherweight.recipe.objectives import objective_of
from featherweight.recipe.schema import TrainConfig
from featherweight.train.run_dir import DATA_SUMMARY


def build_dataset(config: TrainConfig, tokenizer: Tokenizer, train_path: str | Path) -> Dataset:
    """The dataset `config.data` describes (columns, chat and instruction templates, packing),
    laid out as the objective reads its records (`RunObjective.prepare_dataset`: examples, or
    preference pairs), with the eval set from `data.eval` or split off the training records."""
    settings = config.data
    template = settings.instruction_template
    options = dict(
        skip_bad=settings.skip_bad,
        overflow=settings.overflow,
        columns=dict(settings.columns),
        instruction_template=None if template is None else template.template(),
        pack_examples=settings.pack,
        max_per_row=settings.max_documents_per_row,
    )
    tokenizer = with_chat_template(tokenizer, settings.chat_template)
    prepare = objective_of(config).prepare_dataset  # examples in rows, or pairs
    dataset = prepare(
        train_path,
        tokenizer,
        settings.seq_len,
        eval_fraction=0.0 if settings.eval else settings.eval_fraction,
        seed=settings.shuffle_seed,
        **options,
    )
    if not settings.eval:
        return dataset
    held_out = prepare(settings.eval, tokenizer, settings.seq_len, **options)
    return dataset._replace(
        eval=held_out.train,
        eval_stats=held_out.train_stats,
        skipped=dataset.skipped + held_out.skipped,
        records=dataset.records + held_out.records,
        skip_reasons=dataset.skip_reasons + held_out.skip_reasons,
    )


def steps_from_epochs(config: TrainConfig, steps_per_epoch: int) -> TrainConfig:
    """`config` with `steps` = `epochs` x `steps_per_epoch` (rounded up) when `epochs` is set."""
    if config.epochs is None:
        return config
    return config.model_copy(update={"steps": max(1, math.ceil(config.epochs * steps_per_epoch))})


def _split_summary(stats: PackStats | PairStats | None) -> dict[str, Any] | None:
    if stats is None:
        return None
    summary = {**stats._asdict(), "packing_efficiency": round(stats.fill, 4)}
    if isinstance(stats, PairStats):
        summary["drop_reasons"] = [
            {"reason": reason, "count": count} for reason, count in stats.drop_reasons
        ]
    return summary


def data_summary(
    config: TrainConfig, dataset: Dataset, steps_per_epoch: int, source: str
) -> dict[str, Any]:
    """What the data became, as a JSON-ready dict (see the module docstring)."""
    return {
        "source": source,
        "objective": config.objective,
        "records": dataset.records,
        "skipped": dataset.skipped,
        "skip_reasons": [
            {"reason": reason, "count": count, "first": first}
            for reason, count, first in dataset.skip_reasons
        ],
        "packed": config.data.pack,
        "seq_len": config.data.seq_len,
        "train": _split_summary(dataset.train_stats),
        "eval": _split_summary(dataset.eval_stats),
        "batch_size": config.batch_size,
        "steps_per_epoch": steps_per_epoch,
        "steps": config.steps,
        "epochs": round(config.steps / steps_per_epoch, 3),
    }


def counted(number: float, noun: str) -> str:
    """`number` `noun`s in words: "1 step", "2 steps", "1.5 epochs", "12,000 rows"."""
    return f"{number:,g} {noun}" if number == 1 else f"{number:,g} {noun}s"


def _pairs_line(name: str, split: dict[str, Any], seq_len: int) -> str:
    line = (
        f"{name}: {counted(split['pairs'], 'pair')} -> {counted(split['rows'], 'row')} of "
        f"{seq_len + 1} tokens "
        f"({split['packing_efficiency']:.1%} filled, up to {split['most_per_row']} examples a "
        f"row), {split['tokens']:,} tokens ({split['loss_tokens']:,} in completions)"
    )
    if split["truncated_pairs"]:
        line += (
            f"; {split['truncated_pairs']:,} pairs truncated ({split['truncated_tokens']:,} "
            "tokens cut: raise data.seq_len to keep them)"
        )
    for drop in split["drop_reasons"]:
        line += f"; {drop['count']:,} pairs dropped: {drop['reason']}"
    return line


def _split_line(name: str, split: dict[str, Any], seq_len: int) -> str:
    if "pairs" in split:
        return _pairs_line(name, split, seq_len)
    line = (
        f"{name}: {counted(split['examples'], 'example')} -> {counted(split['rows'], 'row')} of "
        f"{seq_len + 1} "
        f"tokens ({split['packing_efficiency']:.1%} filled, up to {split['most_per_row']} a "
        f"row), {split['tokens']:,} tokens ({split['loss_tokens']:,} in the loss)"
    )
    if split["truncated_examples"]:
        line += (
            f"; {split['truncated_examples']:,} truncated ({split['truncated_tokens']:,} tokens "
            "cut: raise data.seq_len to keep them)"
        )
    if split["dropped_examples"]:
        line += f"; {split['dropped_examples']:,} dropped (no loss token left)"
    return line


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the lines printed before the first step."""
    lines = [f"data: {counted(summary['records'], 'record')} read from {summary['source']}"]
    if summary["skipped"]:
        reasons = "; ".join(
            f"{item['count']:,} {item['reason']} (first: {item['first']})"
            for item in summary["skip_reasons"][:3]
        )
        lines[0] += f", {summary['skipped']:,} skipped: {reasons}"
    for name in ("train", "eval"):
        if summary[name] is not None:
            lines.append(_split_line(name, summary[name], summary["seq_len"]))
    lines.append(
        f"steps: {summary['steps']:,} = {counted(summary['epochs'], 'epoch')} of "
        f"{counted(summary['steps_per_epoch'], 'step')} (batch {summary['batch_size']}"
        + ("" if summary["packed"] else ", one example per row")
        + ")"
    )
    return lines


def write_summary(output_dir: Path, summary: dict[str, Any]) -> Path:
    path = output_dir / DATA_SUMMARY
    atomic_write_text(path, json.dumps(summary, indent=2) + "\n")
    return path


def packed_slots_note(config: TrainConfig, attention: str, dataset: Dataset) -> str | None:
    """Where cuDNN's packed attention holds fewer documents a row than the training rows do (no
    `data.max_documents_per_row`): the share of rows whose batches run blockwise instead (exact,
    slower), and the setting that packs to the slots; None where every row fits or cuDNN is
    not the attention."""
    stats = dataset.train_stats
    slots = packed_slots(config)
    if attention != "cudnn" or stats is None or stats.most_per_row <= slots:
        return None
    over = sum(len(row) > slots for row in dataset.train.rows)
    return (
        f"cuDNN's packed attention holds {slots} documents a row and {over} of {stats.rows} "
        f"training rows hold more (up to {stats.most_per_row}): a batch with one runs blockwise "
        f"attention (same result, slower); data.max_documents_per_row: N packs at most N a row "
        f"and gives cuDNN N slots (its workspace grows with N)"
    )
