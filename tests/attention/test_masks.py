"""The masks the plugin's attention receives (``hf_knorm/attention/masks.py``): key padding ``(B, kv)`` for plain causal
calls, the explicit ``(B, 1, q, kv)`` bool mask otherwise, and the same logits and gradients either way.

The exactness reference is the same model routed through a second registration of the plugin's attention whose mask
function always builds the explicit mask (what every call received before key padding). Tolerances (fp32, tiny
models): logits within 1e-5 absolute, each gradient within 1e-5 of its largest entry; measured 0 to 2e-7 (the same
kernels on the same keys: only the mask's form differs).
"""

import warnings

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sliding_window_causal_mask_function

import hf_knorm
from hf_knorm.attention import interface, paths
from hf_knorm.attention.interface import hf_knorm_attention
from hf_knorm.attention.masks import KeyPadding, explicit_bool_mask, hf_knorm_mask
from hf_knorm.attention.paths import attention_paths
from hf_knorm.compat import cache_kwargs
from hf_knorm.models.parameters import hold_normalization
from hf_knorm.models.patching import held_normalization

from tiny_models import assert_same_step, logits_and_grads, tiny_inputs, tiny_model

pytestmark = pytest.mark.compat  # Transformers' mask plumbing, on every supported release

EXPLICIT = "hf_knorm_explicit_mask"
AttentionInterface.register(EXPLICIT, hf_knorm_attention)
AttentionMaskInterface.register(EXPLICIT, explicit_bool_mask)


@pytest.fixture
def received(monkeypatch):
    """The masks the attention function received, one per call (``read_mask`` spied on)."""
    masks = []
    read_mask = interface.read_mask

    def spy(mask, *args, **kwargs):
        masks.append(mask)
        return read_mask(mask, *args, **kwargs)

    monkeypatch.setattr(interface, "read_mask", spy)
    return masks


def _padded(model_type: str, length: int, pad: int = 3) -> dict[str, torch.Tensor]:
    inputs = tiny_inputs(model_type, length=length)
    inputs["attention_mask"][0, :pad] = 0
    return inputs


def _explicit_twin(model):
    """The same model (same weights) whose attention always receives the explicit bool mask."""
    twin = tiny_model(model.config.model_type)
    twin.load_state_dict(model.state_dict())
    twin.config.hf_knorm = dict(model.config.hf_knorm)
    hold_normalization(twin, held_normalization(model))  # what the attention reads (hf_knorm.attention.held)
    twin.set_attn_implementation(EXPLICIT)
    return twin.train(model.training)




@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_a_causal_forward_hands_the_attention_key_padding(received, padded):
    model = hf_knorm.patch(tiny_model("llama"), "x/1")
    inputs = _padded("llama", 140) if padded else tiny_inputs("llama", length=140)
    with torch.no_grad(), attention_paths() as counted:
        model(**inputs)
    assert [tuple(mask.shape) for mask in received] == [(2, 140)] * 2
    assert counted == {"linear": 2}
    if padded:
        assert received[0][0].tolist() == [False] * 3 + [True] * 137


def test_generation_steps_receive_key_padding_of_the_cache(received):
    """Prefill and every decoding step with a K/V cache: key padding over the cached and new keys."""
    model = hf_knorm.patch(tiny_model("llama"), "x^3/16")
    inputs = _padded("llama", 10)
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0, **cache_kwargs(DynamicCache()))
    assert [tuple(mask.shape) for mask in received[::2]] == [(2, 10), (2, 11), (2, 12)]
    assert all(mask[0, :3].tolist() == [False] * 3 for mask in received)


def test_packed_sequences_sliding_windows_and_a_users_mask_get_the_explicit_mask(received):
    packed = hf_knorm.patch(tiny_model("llama"), "x/1")
    positions = torch.cat([torch.arange(70), torch.arange(70)])[None].expand(2, -1)
    with torch.no_grad(), attention_paths() as counted:
        packed(input_ids=tiny_inputs("llama", length=140)["input_ids"], position_ids=positions, use_cache=False)
    assert {tuple(mask.shape) for mask in received} == {(2, 1, 140, 140)}
    assert counted == {"quadratic": 2}  # two sequences in a row: not causal over the row

    received.clear()
    windowed = hf_knorm.patch(tiny_model("mistral"), "x/1")  # sliding window 5 < 12 tokens
    with torch.no_grad():
        windowed(**tiny_inputs("mistral", length=12))
    assert {tuple(mask.shape) for mask in received} == {(2, 1, 12, 12)}

    received.clear()
    users = torch.ones(2, 1, 12, 12, dtype=torch.bool).tril()
    with torch.no_grad():
        packed(input_ids=tiny_inputs("llama", length=12)["input_ids"], attention_mask=users)
    assert received[0] is users


@pytest.mark.parametrize(("model_type", "spelling", "length"), [
    ("llama", "x/1", 140), ("llama", "x/sqrtN", 140), ("llama", "x^3/16", 20), ("llama", "softmax", 20),
    ("qwen3", "x/16", 140), ("gpt2", "x^3/sqrtN", 20), ("gpt_neox", "x/1", 140), ("phi3", "x^3/1", 20),
])
def test_key_padding_gives_the_explicit_masks_logits_and_gradients(model_type, spelling, length):
    model = hf_knorm.patch(tiny_model(model_type), spelling).train()
    inputs = _padded(model_type, length, pad=5)
    assert_same_step(logits_and_grads(model, inputs), logits_and_grads(_explicit_twin(model), inputs),
                     logits_atol=1e-5, grads_relative=1e-5)


@pytest.mark.parametrize(("q_len", "kv_len", "q_offset", "kv_offset"), [(7, 7, 0, 0), (1, 9, 8, 0), (4, 9, 5, 0),
                                                                        (3, 6, 12, 9)])
def test_key_padding_stands_for_the_explicit_mask(q_len, kv_len, q_offset, kv_offset):
    padding = torch.ones(2, kv_offset + kv_len, dtype=torch.bool)
    padding[1, :3] = False
    options = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=q_offset, kv_offset=kv_offset,
                   mask_function=causal_mask_function, attention_mask=padding)
    compact = hf_knorm_mask(**options)
    assert compact.shape == (2, kv_len)
    dense = KeyPadding.of(compact, q_len, kv_len, causal=True).dense()
    assert torch.equal(dense, explicit_bool_mask(**options))


def test_the_explicit_mask_is_built_where_the_call_is_not_plain_causal():
    base = dict(batch_size=1, q_length=6, kv_length=6, attention_mask=None)
    assert hf_knorm_mask(**base, mask_function=sliding_window_causal_mask_function(3)).shape == (1, 1, 6, 6)
    assert hf_knorm_mask(**base, allow_is_causal_skip=False).shape == (1, 1, 6, 6)  # an overlay or packed sequences
    assert hf_knorm_mask(**base, local_size=3).shape == (1, 1, 6, 6)
    static = dict(base, kv_length=16, q_offset=torch.tensor(0))  # a static cache: queries not at the bottom right
    assert hf_knorm_mask(**static).shape == (1, 1, 6, 16)


def test_a_long_fallback_warns_once_with_its_reason(monkeypatch):
    monkeypatch.setattr(paths, "LONG_INPUT", 64)
    monkeypatch.setattr(paths, "_warned", set())
    model = hf_knorm.patch(tiny_model("mistral"), "x/1")  # its sliding window blocks the linear path
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(**tiny_inputs("mistral", length=80))
        model(**tiny_inputs("mistral", length=80))
    messages = [str(w.message) for w in caught if "quadratic kernel" in str(w.message)]
    assert len(messages) == 1 and "80 queries" in messages[0] and "not causal" in messages[0]


def test_a_short_call_or_a_non_linear_normalization_does_not_warn(monkeypatch):
    monkeypatch.setattr(paths, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            hf_knorm.patch(tiny_model("mistral"), "x/1")(**tiny_inputs("mistral", length=12))
            hf_knorm.patch(tiny_model("llama"), "x^3/16")(**tiny_inputs("llama", length=12))


def test_linear_require_raises_on_a_fallback_and_travels_with_the_model(tmp_path):
    model = hf_knorm.patch(tiny_model("mistral"), "x/1", linear="require")
    with pytest.raises(ValueError, match="requires the linear path.*not causal"), torch.no_grad():
        model(**tiny_inputs("mistral", length=12))
    llama = hf_knorm.patch(tiny_model("llama"), "x/1", linear="require")
    with torch.no_grad(), attention_paths() as counted:
        llama(**tiny_inputs("llama", length=12))  # 12 queries: quadratic by choice (faster), not a fallback
        llama(**_padded("llama", 140))
    assert counted == {"quadratic": 2, "linear": 2}
    llama.save_pretrained(tmp_path)
    assert hf_knorm.from_pretrained(tmp_path).config.hf_knorm["linear"] == "require"
    assert "linear" not in hf_knorm.unpatch(llama).config.to_dict().get("hf_knorm", {})


def test_linear_policies_are_checked():
    with pytest.raises(ValueError, match="not a policy"):
        hf_knorm.patch(tiny_model("llama"), "x/1", linear="always")
    with pytest.raises(ValueError, match="has no linear-time path"):
        hf_knorm.patch(tiny_model("llama"), "x^3/16", linear="require")


def test_whether_the_keys_are_all_real_is_read_once_per_shared_mask():
    """Every layer of a forward receives the same mask tensor: :attr:`KeyPadding.all_real` reads it once for all of
    them, and a cut of it (the keys older than a window) without a read when every key is real; a new mask tensor (the
    next forward) is read again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += str(func).startswith("aten._local_scalar_dense")
            return func(*args, **(kwargs or {}))

    real = torch.ones(2, 9, dtype=torch.bool)
    padded = real.clone()
    padded[1, :2] = False
    with Reads():
        layers = [KeyPadding.of(real, 9, 9, causal=True) for _ in range(3)]
        assert all(layer.all_real and layer.first(4, 4).all_real for layer in layers)
        assert Reads.count == 1
        assert not KeyPadding.of(padded, 9, 9, causal=True).all_real
        assert KeyPadding.of(padded, 9, 9, causal=True).first(9, 9).all_real is False
        assert Reads.count == 3  # the whole of the new mask, then its cut (the same keys), once
        assert KeyPadding.of(padded, 1, 7, causal=True).all_real  # its last 7 keys: the padding is cut off
        assert Reads.count == 4
