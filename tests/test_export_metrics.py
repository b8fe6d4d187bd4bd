"""export_metrics: the typed way to declare what a state NamedTuple reports through gtx.metrics."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import gradtx as gtx


@gtx.export_metrics(("hits", "hit_count"), ("last", "last_value"))
class _HitState(NamedTuple):
    hits: torch.Tensor
    last: torch.Tensor
    other: torch.Tensor


def test_export_metrics_reports_the_declared_fields_under_their_names():
    state = _HitState(hits=torch.tensor(3), last=torch.tensor(0.5), other=torch.tensor(7.0))
    found = gtx.metrics((gtx.EmptyState(), {"inner": state}))
    assert set(found) == {"hit_count", "last_value"}
    assert found["hit_count"] is state.hits and found["last_value"] is state.last


def test_export_metrics_returns_the_class_itself_and_matches_the_runtime_attribute_form():
    class Plain(NamedTuple):
        hits: torch.Tensor
        _metrics = (("hits", "hit_count"),)  # the older spelling: still read

    assert _HitState._fields == ("hits", "last", "other")
    state = Plain(hits=torch.tensor(2))
    assert gtx.metrics(state) == {"hit_count": state.hits}


def test_export_metrics_refuses_unknown_fields_and_non_namedtuples():
    with pytest.raises(ValueError, match=r"export_metrics: .*no field\(s\) \['nope'\]"):

        @gtx.export_metrics(("nope", "x"))
        class Bad(NamedTuple):
            hits: torch.Tensor

    with pytest.raises(TypeError, match="export_metrics: decorates a NamedTuple class"):

        @gtx.export_metrics(("hits", "x"))
        class NotATuple:
            hits: torch.Tensor

    with pytest.raises(TypeError, match=r"export_metrics: each pair must be a \(field name, metric name\)"):
        gtx.export_metrics("hits")  # type: ignore[arg-type]


def test_library_states_declare_their_metrics_with_existing_fields():
    for cls in (gtx.ClipByGlobalNormState, gtx.AccumulateState, gtx.ApplyIfFiniteState):
        assert cls._metrics, cls
        assert all(field in cls._fields for field, _ in cls._metrics), cls
