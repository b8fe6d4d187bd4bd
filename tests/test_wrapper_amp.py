"""gradtx.wrapper.amp: GradScaler's flags across an accumulation window, worked by hand."""

import pytest
import torch

from gradtx.wrapper import amp

T, F_ = torch.tensor(1.0), torch.tensor(0.0)


def test_no_gradscaler_no_verdict():
    v = amp.verdict(None, None, None, None, emitted=True, window_open=False)
    assert v == amp.AmpVerdict(None, None, None, False)


def test_a_held_micro_step_records_the_scale_and_an_inf_drops_the_partial_sum():
    scale = torch.tensor(1024.0)
    v = amp.verdict(F_, scale, None, None, emitted=False, window_open=True)
    assert float(v.scale) == 1024.0 and not bool(v.inf) and not v.drop_partial_sum
    v = amp.verdict(T, scale, v.scale, v.inf, emitted=False, window_open=True)
    assert bool(v.inf) and v.drop_partial_sum
    # the emitting step skips: an earlier micro-step saw an inf
    v = amp.verdict(F_, scale, v.scale, v.inf, emitted=True, window_open=False)
    assert bool(v.found) and v.scale is None and v.inf is None


def test_a_scale_changed_inside_the_window_skips_the_step():
    v = amp.verdict(F_, torch.tensor(2.0), torch.tensor(4.0), torch.tensor(False), emitted=True, window_open=False)
    assert bool(v.found)
    v = amp.verdict(F_, torch.tensor(4.0), torch.tensor(4.0), torch.tensor(False), emitted=True, window_open=False)
    assert not bool(v.found)


def test_unscale_on_a_held_micro_step_is_refused():
    with pytest.raises(ValueError, match=r"unscale_\(opt\) was called on a micro-step that does not emit"):
        amp.check_flags(F_, None, emitting=False, summed=False)
    amp.check_flags(F_, None, emitting=True, summed=False)


def test_the_record_round_trips_and_zero_means_none():
    assert amp.restore(amp.record(None, None), torch.device("cpu"), what="t") is None
    scale, inf = amp.restore(amp.record(torch.tensor(8.0), torch.tensor(True)), torch.device("cpu"), what="t")
    assert float(scale) == 8.0 and bool(inf)
    assert float(amp.inv_scale(torch.tensor(8.0))) == 0.125
