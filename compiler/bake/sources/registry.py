"""The fit-data sources, in the order their rows stand in ``FitData``: a new source is its
module and its line here."""

from __future__ import annotations

from ctxc.bake.sources.base import Source
from ctxc.bake.sources.cloze import Cloze
from ctxc.bake.sources.file import QueryFile
from ctxc.bake.sources.offtopic import OffTopicQuestions, OffTopicReading, OffTopicText
from ctxc.bake.sources.samples import Samples
from ctxc.bake.sources.selfstudy import SelfStudy

__all__ = ["SOURCES", "asked_kinds"]

SOURCES: tuple[Source, ...] = (
    QueryFile(),
    SelfStudy(),
    Cloze(),
    Samples(),
    OffTopicText(),
    OffTopicQuestions(),
    OffTopicReading(),
)


def asked_kinds() -> tuple[str, ...]:
    """The kinds whose rows are a question then its answer (``Source.asks``)."""
    return tuple(s.kind for s in SOURCES if s.asks)
