"""The callback-order workaround (hf_knorm.compat.run_callback_first): NormLoggerCallback's on_log runs before the
report_to integrations, so the norms reach TensorBoard in the same log call. Compatibility suite: these fail the day a
Transformers release moves the Trainer's callback list out of reach."""

from __future__ import annotations

import glob
import warnings

import pytest
import transformers as tf
from training_helpers import args, lm, lm_data

import hf_knorm
from hf_knorm.compat import run_callback_first

pytestmark = pytest.mark.compat


class Recorder(tf.TrainerCallback):
    """Counts the events it receives."""

    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def on_init_end(self, args, state, control, **kwargs):
        self.seen.append(self.name)


class MovesItselfFirst(Recorder):
    def on_init_end(self, args, state, control, **kwargs):
        super().on_init_end(args, state, control, **kwargs)
        assert run_callback_first(self)


def _handler(callbacks):
    return tf.trainer_callback.CallbackHandler(callbacks, None, None, None, None)


def test_norms_reach_tensorboard_in_a_real_trainer_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = hf_knorm.NormLoggerCallback()
    trainer = tf.Trainer(model=lm(), args=args(tmp_path, max_steps=3, logging_steps=1, report_to=["tensorboard"]),
                         train_dataset=lm_data(), callbacks=[callback])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="NormLoggerCallback could not reach")  # fail loudly, not quietly
        trainer.train()
    assert callback.reaches_integrations
    callbacks = trainer.callback_handler.callbacks
    assert callbacks[0] is callback
    printer = next(i for i, c in enumerate(callbacks) if isinstance(c, tf.trainer_callback.PrinterCallback))
    assert callbacks[printer - 1] is callback._console_filter  # just before the console printer, once
    assert sum(c is callback._console_filter for c in callbacks) == 1

    events = glob.glob(str(tmp_path / "runs" / "*" / "events.out.tfevents.*"))
    assert len(events) == 1
    accumulator = EventAccumulator(events[0])
    accumulator.Reload()
    logged = [entry for entry in trainer.state.log_history if "norms/layer_00/attn_fro" in entry]
    assert [entry["step"] for entry in logged] == [1, 2, 3]
    for key in ("norms/layer_00/attn_fro", "norms/layer_01/kv_ratio"):
        scalars = accumulator.Scalars(f"train/{key}")
        assert [s.step for s in scalars] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx([entry[key] for entry in logged], rel=1e-6)


def test_a_second_train_keeps_one_companion_and_the_order(tmp_path):
    callback = hf_knorm.NormLoggerCallback()
    trainer = tf.Trainer(model=lm(), args=args(tmp_path, max_steps=1, logging_steps=1), train_dataset=lm_data(),
                         callbacks=[callback])
    trainer.train()
    before = list(trainer.callback_handler.callbacks)
    trainer.train()
    assert trainer.callback_handler.callbacks == before and before[0] is callback


def test_moving_first_during_an_event_calls_every_callback_once():
    seen = []
    handler = _handler([tf.trainer_callback.DefaultFlowCallback(), Recorder("a", seen), MovesItselfFirst("me", seen),
                        Recorder("b", seen)])
    handler.on_init_end(None, None, None)
    assert seen == ["a", "me", "b"]  # the event in progress finishes over the list it started with
    assert [getattr(c, "name", None) for c in handler.callbacks] == ["me", None, "a", "b"]


def test_the_handler_is_found_when_its_attribute_dict_exists(tmp_path):
    callback = Recorder("me", [])
    handler = _handler([tf.trainer_callback.DefaultFlowCallback(), callback])
    vars(handler)  # materialized __dict__: the list's referrer is the dict, not the handler
    assert run_callback_first(callback)
    assert handler.callbacks[0] is callback


def test_a_callback_in_no_trainer_is_reported():
    callback = Recorder("me", [])
    users_list = [callback]  # a plain list holding it is not a Trainer's
    assert not run_callback_first(callback)
    assert users_list == [callback]


def test_the_callback_warns_when_it_cannot_reach_the_list(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_knorm.training.callback, "run_callback_first", lambda *a, **k: False)
    callback = hf_knorm.NormLoggerCallback()
    trainer = tf.Trainer(model=lm(), args=args(tmp_path, max_steps=2, logging_steps=1), train_dataset=lm_data(),
                         callbacks=[callback])
    with pytest.warns(UserWarning, match=r"could not reach the Trainer's callback list.*not in TensorBoard/W&B"):
        trainer.train()
    assert not callback.reaches_integrations
    assert [e["step"] for e in trainer.state.log_history if "norms/layer_00/attn_fro" in e] == [1, 2]
