"""The page reads turn_done's figures by the names the server sends (``protocol.TurnMetrics``)."""

from __future__ import annotations

import re
from pathlib import Path

from app import protocol

WEB = Path(__file__).resolve().parents[2] / "web"
FIELDS = set(protocol.TurnMetrics.model_fields)


def test_the_tooltip_labels_only_real_figures():
    source = (WEB / "ui.js").read_text()
    table = re.search(r"METRIC_LABELS = \{(.*?)\};", source, re.S)
    assert table, "web/ui.js has no METRIC_LABELS table"
    names = re.findall(r"^\s*(\w+):", table.group(1), re.M)
    assert names and set(names) <= FIELDS, set(names) - FIELDS
    assert set(protocol.LATENCY_FIELDS) <= set(names)  # every latency is shown


def test_no_page_script_reads_a_figure_the_server_never_sends():
    for path in sorted(WEB.glob("*.js")):
        read = set(re.findall(r"\bmetrics\??\.(\w+)", path.read_text()))
        assert read <= FIELDS, f"{path.name} reads {read - FIELDS} from turn_done.metrics"
