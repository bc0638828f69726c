"""torch.compile of a model with a softmax window: no graph break (``fullgraph=True``), the eager values.

The softmax part's blocks and the quadratic polynomial part run through the custom op, the ``p = 1`` part is traced
(the linear kernel). Tolerances as tests/attention/test_compile.py (fp32): logits within 1e-5 absolute of eager; each
parameter's gradient within 1e-4 of its largest entry. Each case compiles forward and backward (~30-60 s on a CPU).
"""

import pytest
import torch

import hf_knorm
from hf_knorm.attention.paths import attention_paths
from hf_knorm.attention.taps import taps_set

from tiny_models import assert_same_step, logits_and_grads, tiny_inputs, tiny_model


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()




# with_mix: a conversion's mix, saved in the config, read in the graph; every route runs with one, the band route
# also without. Each inductor case compiles a forward and a backward (20-60 s: the slowest tests of the suite), so
# inductor compiles the band route with sinks, which holds the band route's kernels and the traced linear kernel, on
# a one-layer model (the second layer's graph is the first one's: 35 s instead of 49 s with an empty compile cache);
# the other cases run aot_eager (Dynamo's capture, AOTAutograd's forward and backward, no code generation), the custom
# op they call compiled by inductor in tests/attention/test_compile.py.
@pytest.mark.parametrize(("model_type", "spelling", "window", "length", "path", "with_mix", "backend"), [
    # key padding: the linear kernel traced, the band blocks through the op
    ("llama", "x/1", 8, 140, "linear", False, "aot_eager"),
    ("llama", "x/1", 8, 140, "linear", True, "aot_eager"),
    # the model's own sliding window: explicit masks through the op
    ("mistral", "x^3/16", 3, 12, "quadratic", True, "aot_eager"),
    ("llama", "x/1 + softmax window 8 + sinks 2", 8, 140, "linear", True, "inductor"),  # the sinks found in the graph
])
def test_a_compiled_windowed_model_matches_eager(model_type, spelling, window, length, path, with_mix, backend):
    layers = 1 if backend == "inductor" else None
    model = hf_knorm.patch(tiny_model(model_type, layers=layers).train(), spelling, softmax_window=window)
    if with_mix:
        from hf_knorm.models.window_mix import set_window_mix

        heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
        set_window_mix(model, [[0.5 + 0.1 * head - 0.2 * layer for head in range(heads)] for layer in range(layers)])
    inputs = tiny_inputs(model_type, length=length)
    inputs["attention_mask"][0, :3] = 0
    with attention_paths() as taken:
        eager_logits, eager_grads = logits_and_grads(model, inputs)
    assert dict(taken) == {path: model.config.num_hidden_layers}
    assert not taps_set()
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break is an error
    assert_same_step(logits_and_grads(compiled, inputs), (eager_logits, eager_grads), logits_atol=1e-5,
                     grads_relative=1e-4)
