"""Every option explains itself, stages have one vocabulary, and transformers stays quiet."""

from __future__ import annotations

import argparse

from gpt_inspector.cli import build_parser, quiet_transformers
from gpt_inspector.core.attention import KIND_LABELS, KIND_TITLES, KINDS


def _actions(parser, name="gpt-inspector"):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub_name, sub in a.choices.items():
                yield from _actions(sub, sub_name)
        else:
            yield name, a


def test_every_option_has_help_text():
    missing = [(cmd, a.option_strings or a.dest) for cmd, a in _actions(build_parser())
               if a.dest != "help" and not (a.help or "").strip()]  # fmt: skip
    assert missing == []


def test_export_kind_names_the_stages_as_the_window_does():
    parser = build_parser()
    kind = next(a for cmd, a in _actions(parser) if cmd == "export" and a.dest == "kind")
    assert set(kind.choices) == set(KINDS)
    for k in KINDS:
        assert f"{k} = {KIND_TITLES[k]}" in kind.help
    assert KIND_LABELS == {"raw": "raw QKᵀ", "scores": "scores (scaled)", "masked_scores": "masked_scores (masked)",
                            "probs": "probs (softmax)"}  # fmt: skip


def test_quiet_transformers_silences_warnings_and_progress_bars():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    hf_logging.enable_progress_bar()
    try:
        quiet_transformers()
        assert hf_logging.get_verbosity() == hf_logging.ERROR
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        hf_logging.set_verbosity_warning()
        hf_logging.enable_progress_bar()


def test_quiet_transformers_silences_the_hubs_retry_lines():
    """An uncached hub id with the hub unreachable: huggingface_hub logs every retry ("Retrying in
    8s [Retry 4/5]") at WARNING on its own logger, above our one-line error; quiet turns them off."""
    import logging

    from huggingface_hub.utils import logging as hub_logging

    retries = logging.getLogger("huggingface_hub.utils._http")  # where http_backoff logs its retries
    hub_logging.set_verbosity_warning()
    try:
        assert retries.isEnabledFor(logging.WARNING)  # the test can fail: on by default
        quiet_transformers()
        assert not retries.isEnabledFor(logging.WARNING)
        assert retries.isEnabledFor(logging.ERROR)
    finally:
        hub_logging.set_verbosity_warning()
