"""Every reach of hf_knorm into Transformers beyond its public extension points, in one module.

The rule: the package uses what Transformers offers plugins (``AttentionInterface``, ``AttentionMaskInterface``,
cache layers, ``TrainerCallback`` events, config attributes, the pipeline registry); where no public point exists,
the workaround lives here, in its own section, with a docstring that names the Transformers behaviour it works
around and the versions it was checked on, and a test in the compatibility suite (``pytest -m compat``, run on every
supported Transformers version: the oldest, a middle and the newest by ``.ci/run``) that fails loudly the day it
stops working. The first section is the supported range itself and the differences between releases.

This module sits at the bottom of the package's layers: it imports Transformers (torch if a workaround needs it),
nothing of hf_knorm. Sections are independent (each with its own imports), so a workaround is added or removed as a
block.
"""

# =====================================================================================================================
# Transformers version differences: the supported range, and what changed between releases
# =====================================================================================================================

import re

import transformers

# Checked on every 5.x minor from 5.10 to 5.24 (sources), tested by the compatibility suite on 5.10.4, 5.17.0 and
# 5.24.0 (docs/compatibility.md "Supported Transformers versions").

SUPPORTED_TRANSFORMERS = ">=5.10,<6"
"""The supported range, as pyproject.toml declares it: every 5.x minor from 5.10 on, up to the next major."""
_OLDEST, _NEXT_MAJOR = (5, 10), (6, 0)

_CACHE_RENAMED = (5, 24)
"""5.24 renamed the cache argument of ``forward``/``generate`` and the output field from ``past_key_values`` to
``cache``. 5.24 still takes the old name with a deprecation warning (until 6.0); 5.10-5.23 ignore ``cache=`` in a
model's ``forward`` (it lands in ``**kwargs``) and ``generate`` refuses it as an unused model argument."""


def installed_transformers_version() -> str:
    """The version string of the Transformers that is imported (``transformers.__version__``)."""
    return transformers.__version__


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"5.24.0"`` or ``"5.25.0.dev0"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"Cannot read a Transformers version from {version!r}.")
    return int(match[1]), int(match[2])


def check_transformers_version() -> None:
    """Refuse a Transformers release outside :data:`SUPPORTED_TRANSFORMERS`, at ``import hf_knorm``.

    Outside the range the package would fail later and deeper (4.57 at import: 4.x spells the config class
    ``PretrainedConfig``; 5.0-5.9 were never tried), or silently (a future major); this says so at import, with the
    fix. Tested by ``tests/test_compat_versions.py`` (the version read is monkeypatched, the package re-imported).

    Raises:
        ImportError: The installed release is older than 5.10 or of a later major version.
    """
    version = installed_transformers_version()
    if not _OLDEST <= _release(version) < _NEXT_MAJOR:
        raise ImportError(
            f"hf_knorm supports transformers{SUPPORTED_TRANSFORMERS} (every 5.x minor from 5.10 on); transformers "
            f"{version} is installed. Install a supported release: pip install 'transformers{SUPPORTED_TRANSFORMERS}'."
        )


def cache_keyword() -> str:
    """The keyword that passes a cache to a model's ``forward`` and to ``generate``: ``"cache"`` from 5.24 on,
    ``"past_key_values"`` before (see ``_CACHE_RENAMED``). Model outputs name their cache field the same way.
    Tested by ``test_the_cache_keyword_reaches_forward_and_generate``: a wrong keyword leaves the passed cache empty."""
    return "cache" if _release(installed_transformers_version()) >= _CACHE_RENAMED else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{keyword: cache}`` for ``model(..., **cache_kwargs(cache))`` and ``model.generate(..., **cache_kwargs(cache))``
    on every supported release (the keyword is :func:`cache_keyword`)."""
    return {cache_keyword(): cache}


def output_cache(outputs):
    """The cache a model's forward returned: ``outputs.cache`` from 5.24 on, ``outputs.past_key_values`` before."""
    return outputs[cache_keyword()]


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Per layer of a decoder ``config``: its attention type (``"full_attention"``, ``"sliding_attention"``, ...) and
    the keyword arguments its cache layer takes (``{"sliding_window": w}`` for a windowed layer).

    Transformers' ``cache_utils.get_layer_types_and_kwargs`` answers this from 5.14 on, returning one kwargs dict
    shared by all layers until 5.18 and a list of per-layer dicts from 5.19; 5.10-5.13 have no such function and
    ``DynamicCache(config=...)`` reads ``layer_types``, else ``sliding_window``/``attention_chunk_size``, inline (the
    fallback below does the same). Tested by ``test_layer_types_agree_with_transformers_own_cache``.
    """
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # 5.10-5.13
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            kind = "full_attention" if window is None else "sliding_attention"
            layer_types = [kind] * config.num_hidden_layers
        shared = getattr(config, "num_kv_shared_layers", None)
        if shared:
            layer_types = layer_types[:-shared]
        layer_kwargs = {} if window is None else {"sliding_window": window}
    else:
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    if isinstance(layer_kwargs, dict):  # 5.10-5.18: one dict for every layer
        layer_kwargs = [dict(layer_kwargs) for _ in layer_types]
    return list(layer_types), list(layer_kwargs)


def attentions_being_collected() -> bool:
    """Whether the running forward collects attention weights through Transformers' output capturing.

    Some families (GPT-2) consume ``output_attentions`` before calling the attention function, which then cannot see
    the request; their weights are gathered by the hooks of ``transformers.utils.output_capturing``, whose private
    context variable ``_active_collector`` holds what is being collected. No public accessor exists (checked 5.10-5.24;
    the module appeared in 5.5). Tested by ``test_output_attentions_returns_post_normalization_weights[gpt2]`` (in the
    compatibility suite): if the variable goes, this import fails loudly instead of returning no weights.
    """
    from transformers.utils.output_capturing import _active_collector

    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def attn_implementation_of(config) -> str | None:
    """The attention implementation a config currently selects (``"sdpa"``, ``"eager"``, ``"hf_knorm"``, ...).

    Transformers exposes it only as ``config._attn_implementation`` (a property over the internal field; 5.10-5.24),
    while ``PreTrainedModel.set_attn_implementation`` is the public setter. Tested by ``tests/models/test_patching.py``
    (``compat``): unpatch gives back exactly the implementation the model had.
    """
    return config._attn_implementation


# =====================================================================================================================
# Trainer callback order: a callback's on_log before the report_to integrations (NormLoggerCallback)
# =====================================================================================================================

import gc

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, PrinterCallback, ProgressCallback

# Matched by name: transformers.utils.notebook imports IPython.
_CONSOLE_PRINTER_NAMES = ("NotebookProgressCallback",)


def run_callback_first(callback: TrainerCallback, console_filter: TrainerCallback | None = None) -> bool:
    """Put ``callback`` first in the callback list of every Trainer that holds it; ``False`` if none does.

    Works around: the ``Trainer`` calls each event on its callbacks in list order, and builds that list as
    ``DefaultFlowCallback``, then the ``report_to`` integrations (``TensorBoardCallback``, ``WandbCallback``, ...),
    then the user's ``callbacks=``, then the console printer (``Trainer.__init__``). ``Trainer.log`` passes one
    ``logs`` dict to ``on_log`` of each in turn, so a value a user callback adds to ``logs`` reaches no integration.
    No public way places a callback before the integrations: ``callbacks=`` and ``Trainer.add_callback`` append, and
    no event receives the Trainer or its ``CallbackHandler``: ``CallbackHandler.call_event`` passes ``model``,
    ``processing_class``, ``optimizer``, ``lr_scheduler``, the two dataloaders and what the Trainer passes the
    handler's ``on_*`` method (``logs``, ``metrics``, ...), never the Trainer itself (read in the sources of 5.17,
    5.18 and 5.24; those of 5.10 and 5.25 were not at hand, the compatibility test runs on 5.10). The public
    ``Trainer.callback_handler`` is reachable only by whoever holds the Trainer, which a callback passed as
    ``callbacks=[...]`` (or to TRL's trainers, or to a job's own Trainer subclass) never does.

    How: the handler is found as what it is, the ``CallbackHandler`` whose ``callbacks`` list holds ``callback``,
    through the garbage collector's referrer lists (:func:`gc.get_referrers`: the lists that hold the callback, then
    the objects that hold those lists). This depends only on the handler keeping its callbacks in a plain list
    attribute named ``callbacks`` (its documented role), not on who calls the event (a call-stack walk breaks with
    each refactor of the training loop and with Trainer subclasses such as TRL's). Each search costs two or three
    passes over the objects Python tracks (about 0.1 s each with a model loaded), once per ``train()``. The list is
    replaced by a reordered copy, never changed in place: an event iterating over the old list at that moment
    finishes over it unchanged.

    Args:
        callback: the callback to run first.
        console_filter: a callback to place just before the console printer (``ProgressCallback``,
            ``PrinterCallback``, ``NotebookProgressCallback``), e.g. one that takes keys out of ``logs`` before they
            are printed; added once. Not placed when the Trainer has no console printer.

    Returns:
        Whether at least one Trainer's list holds ``callback`` (and now starts with it).

    When: called by the callback itself at ``on_train_begin`` (``NormLoggerCallback``, ``WindowDropoutCallback``): it
    installs nothing process-wide and touches only the Trainers that hold the callback; a second call leaves an
    ordered list as it is.

    Checked on: Transformers 5.24 (``CallbackHandler.callbacks``; ``call_event`` iterates over it).
    Test: ``tests/training/test_training_callback_order.py`` (``compat``): a 3-step ``Trainer`` with
    ``report_to=["tensorboard"]`` whose event file must hold the norm scalars, with the callback's "could not reach"
    warning turned into an error; a second ``train()`` keeps one companion and the order; the reordering during an
    event in progress; the handler found with and without a materialized ``__dict__``.
    """
    handlers = _handlers_holding(callback)
    for handler in handlers:
        current = handler.callbacks
        ordered = [callback] + [c for c in current if c is not callback and c is not console_filter]
        if console_filter is not None:
            printer = next((i for i, c in enumerate(ordered) if _is_console_printer(c)), None)
            if printer is not None:
                ordered.insert(printer, console_filter)
        if len(ordered) != len(current) or any(a is not b for a, b in zip(ordered, current)):
            handler.callbacks = ordered
    return bool(handlers)


def _handlers_holding(callback: TrainerCallback) -> list[CallbackHandler]:
    """Every ``CallbackHandler`` whose ``callbacks`` list holds ``callback`` (by identity)."""
    lists = [holder for holder in gc.get_referrers(callback)
             if type(holder) is list and any(item is callback for item in holder)]
    if not lists:
        return []
    handlers, attribute_dicts = [], []
    for owner in gc.get_referrers(*lists):
        if issubclass(type(owner), CallbackHandler):
            handlers.append(owner)
        elif type(owner) is dict and any(owner.get("callbacks") is holder for holder in lists):
            attribute_dicts.append(owner)  # the handler's __dict__, where Python has materialized one
    if attribute_dicts:
        handlers += [owner for owner in gc.get_referrers(*attribute_dicts) if issubclass(type(owner), CallbackHandler)]
    found, seen = [], set()
    for handler in handlers:
        if id(handler) not in seen and any(holder is getattr(handler, "callbacks", None) for holder in lists):
            seen.add(id(handler))
            found.append(handler)
    return found


def _is_console_printer(callback: TrainerCallback) -> bool:
    printers = (ProgressCallback, PrinterCallback)
    return isinstance(callback, printers) or type(callback).__name__ in _CONSOLE_PRINTER_NAMES


# =====================================================================================================================
# Config marker: "attn_implementation" survives a plain save (the "hf_knorm" attention)
# =====================================================================================================================

import functools  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402

from transformers import PretrainedConfig  # noqa: E402  (4.x's name; 5.x keeps it as an alias of PreTrainedConfig)

_WRAPPED = "__hf_knorm_keeps_attn_implementation__"
_KEPT_IMPLEMENTATIONS: dict[str, Callable[[dict], bool]] = {}


def _register_once(registry: dict, name: str, function: Callable, what: str) -> None:
    """Put ``function`` under ``name`` in one of this module's registries: the same function again changes nothing,
    another one under a taken name is refused (it would silently replace the first, or be silently ignored).

    Raises:
        ValueError: ``name`` already holds a different function.
    """
    held = registry.get(name)
    if held is not None and held is not function:
        raise ValueError(f"{what} {name!r} is already registered with {_qualified(held)}; it cannot also be "
                         f"{_qualified(function)}. Register the new function under a name of its own.")
    registry[name] = function


def _qualified(function: Callable) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def keep_attn_implementation_on_save(name: str, runs_it: Callable[[dict], bool]) -> None:
    """Make every config that ``runs_it`` accepts save ``"attn_implementation": name`` in ``config.json``.

    ``from_pretrained`` then selects the attention implementation ``name`` again (and, where ``name`` is not
    registered, fails with Transformers' error naming it instead of loading the default attention).

    Works around: Transformers does not serialize the attention implementation. It keeps it in the private field
    ``config._attn_implementation_internal`` and drops that field when it serializes a config
    (``PreTrainedConfig._remove_keys_not_serialized``); ``from_pretrained`` reads ``attn_implementation`` from
    ``config.json`` into that field and keeps no plain attribute. A model loaded with plain ``from_pretrained`` and
    saved again at once (``model.save_pretrained``, ``model.push_to_hub``, a Trainer checkpoint) would lose the key,
    and the next load would silently use the default attention (softmax) instead of the plugin's. No public hook of
    the loading or saving path reaches such a config.

    How: ``_remove_keys_not_serialized`` is wrapped class-wide, once. It receives the config as a dict (before the
    private keys are removed); when ``runs_it(d)`` holds, ``d["attn_implementation"] = name``. That method is the one
    point every save path goes through (``to_dict`` and ``to_diff_dict``, hence ``save_pretrained``,
    ``to_json_string``, ``push_to_hub``; nested sub-configs too, since it recurses through itself). Configs that
    ``runs_it`` does not accept serialize exactly as before. Registering a name again with the same ``runs_it``
    changes nothing; with another one it is a ``ValueError``. If a Transformers release has no such method, this warns
    and changes nothing (``import hf_knorm`` still works; a plain save after a plain load then loses the key again,
    and the compatibility test fails).

    When: at ``import hf_knorm`` (:func:`hf_knorm.attention.registration.register`), not lazily: a config is loaded
    and saved with no plugin call in between (``AutoConfig.from_pretrained`` then ``save_pretrained``, a Hub tool
    copying a repository's config), so nothing of the plugin could install it first.

    Args:
        name: the attention implementation registered with ``AttentionInterface``.
        runs_it: ``(config dict) -> bool``, from the config's own serialized keys (e.g. the plugin's section).

    Raises:
        ValueError: ``name`` is already kept for another ``runs_it``.

    Checked on: Transformers 5.24.
    Test: ``tests/models/test_models_marker.py`` (``compat``): a model loaded with plain ``from_pretrained`` and
    saved at once with plain ``save_pretrained`` keeps the key and loads back with the same logits (llama, gemma2,
    bert); a config saved alone keeps it; other configs serialize as before; the wrap is installed once;
    ``tests/test_compat_reaches.py``: a second ``runs_it`` is refused, a plain model saves the same bytes.
    """
    _register_once(_KEPT_IMPLEMENTATIONS, name, runs_it, "The saved attention implementation")
    original = getattr(PretrainedConfig, "_remove_keys_not_serialized", None)
    if original is None:
        warnings.warn(
            f"This Transformers ({transformers.__version__}) has no PretrainedConfig._remove_keys_not_serialized: a "
            f"model loaded with plain from_pretrained and saved again at once will not keep attn_implementation="
            f"{name!r} (please report it to hf_knorm).",
            stacklevel=2,
        )
        return
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def _remove_keys_not_serialized(self, d):
        for kept_name, runs in _KEPT_IMPLEMENTATIONS.items():
            if runs(d):
                d["attn_implementation"] = kept_name
        return original(self, d)

    setattr(_remove_keys_not_serialized, _WRAPPED, True)
    PretrainedConfig._remove_keys_not_serialized = _remove_keys_not_serialized


# =====================================================================================================================
# KNorm cache: the position ids a model passes to Cache.update
# =====================================================================================================================

from collections.abc import Mapping  # noqa: E402

import torch  # noqa: E402

# No public API hands a cache the position ids of the tokens it stores; KNormCache needs them only to refuse a padded
# batch (eviction breaks the padding-mask bookkeeping). The guard is best effort: where the positions are not passed
# the check is skipped, and knorm_generate and the knorm-text-generation pipeline check the attention mask themselves.


def update_position_ids(update_kwargs: Mapping) -> torch.Tensor | None:
    """The (B, q) position ids a model passes along with its keys and values to ``Cache.update``, or ``None``.

    Works around: no public API gives a cache the positions it stores. Transformers behaviour relied on (checked on
    5.24): Llama-style attention modules (llama, mistral, qwen2/3,
    gemma2/3, phi3, gpt2) call ``cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)``, forwarding
    the attention's keyword arguments, which carry ``position_ids`` when the model is called by ``generate`` or with
    explicit ``position_ids``. GPT-NeoX calls ``update`` without them; Transformers 4.x passed a ``cache_kwargs`` dict
    (``sin``, ``cos``, ``cache_position``) instead. In those cases this returns ``None``.

    Args:
        update_kwargs: The keyword arguments ``Cache.update`` received.

    Test: ``tests/eviction/test_knorm_cache.py`` (``compat``): inside ``generate`` the cache sees the position ids, and a
    padded batch is refused.
    """
    forwarded = update_kwargs.get("kwargs")
    if not isinstance(forwarded, Mapping):
        return None
    return forwarded.get("position_ids")


# =====================================================================================================================
# Generation: the cache `generate` builds when the call brings none (constant-size decoding of p = 1 models)
# =====================================================================================================================

import inspect  # noqa: E402

from transformers import DynamicCache  # noqa: E402
from transformers.generation import GenerationMixin  # noqa: E402
from transformers.generation.configuration_utils import GenerationMode  # noqa: E402

_CHOOSES = "__hf_knorm_chooses_the_default_cache__"
_CACHE_CHOOSERS: dict[str, Callable] = {}


def choose_default_generation_cache(name: str, choose: Callable) -> None:
    """Let ``choose(model, rewinds, max_cache_length)`` replace the ``DynamicCache`` that ``generate`` builds for a call
    that brings no cache and asks for no kind of cache; ``choose`` returns the cache to decode with, or ``None`` to
    keep the ``DynamicCache``. ``rewinds``: the call crops its cache (assisted or prompt-lookup decoding, or the call
    is an assistant's own), which a cache that sums the past cannot do; ``max_cache_length``: the most tokens a
    sequence's cache may hold in the call (``generate``'s ``max_length - 1``).

    Works around: a model loaded by plain ``from_pretrained`` (or built by ``from_config``) from a config that the
    plugin patched runs no plugin code before its first attention call, and no public seam lets a plugin choose the
    cache ``generate`` decodes with: ``generate`` builds ``DynamicCache(config=...)`` in
    ``GenerationMixin._prepare_cache_for_generation`` (a ``cache_implementation`` names only Transformers' own
    kinds; a ``custom_generate`` loads only with ``trust_remote_code``). So an ``x/1`` model decoded with a K/V cache
    that grows with the context, silently, unless it was loaded by ``hf_knorm.from_pretrained``.

    How: ``_prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
    max_cache_length)`` (5.10-5.24) is wrapped class-wide, once. After it ran, if the call brought no cache, asked
    for none (``cache_implementation`` unset, ``use_cache`` not False) and it put an exact ``DynamicCache`` under
    the cache keyword (:func:`cache_keyword`), each registered ``choose`` is asked in turn and the first cache it
    returns replaces the ``DynamicCache``. Every other call, and every model a ``choose`` returns ``None`` for, gets
    what Transformers builds. ``generate`` then continues with the cache each forward returns, as with any cache.
    The wrapped method's arguments are bound by its own signature (``generation_mode`` read by name, whether
    ``generate`` passes it by position or by keyword). If a Transformers release has no such method, this warns and
    changes nothing (``import hf_knorm`` still works; such a model then decodes with a growing cache unless
    ``generate`` is given one, and the compatibility test fails).

    When: lazily, by the first call that makes a ``p = 1`` model (:func:`hf_knorm.patch`, or the build hook of
    :func:`add_parameters_when_built` for a model built from a config carrying such a normalization: any
    ``from_pretrained``, ``from_config``, a pipeline); a process that never builds one keeps Transformers' method.

    Args:
        name: the chooser's name (the same ``choose`` again changes nothing; another one is a ``ValueError``).
        choose: ``(model, rewinds: bool, max_cache_length: int) -> Cache | None``.

    Raises:
        ValueError: ``name`` already chooses with another function.

    Checked on: Transformers 5.10 (source) and 5.24.
    Test: ``tests/recurrent/test_plain_load.py`` (``compat``): an ``x/1`` model saved by hf_knorm and loaded by plain
    ``AutoModelForCausalLM.from_pretrained`` generates with a ``RecurrentStateCache`` and the tokens of
    ``hf_knorm.from_pretrained``; the wrap is installed once; a Transformers without the method gets a warning;
    ``tests/test_compat_reaches.py``: installed only by the first such model, ``generation_mode`` read by position
    and by keyword, a second ``choose`` refused.
    """
    _register_once(_CACHE_CHOOSERS, name, choose, "The generation cache chooser")
    original = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    if original is None:
        warnings.warn(
            f"This Transformers ({transformers.__version__}) has no GenerationMixin._prepare_cache_for_generation: "
            f"generate keeps its own cache for every model ({name!r} cannot choose one); decode an x/1 model with "
            "its constant-size state by passing cache=hf_knorm.RecurrentStateCache(config=model.config) "
            "(please report it to hf_knorm).",
            stacklevel=2,
        )
        return
    if getattr(original, _CHOOSES, False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        generation_config, model_kwargs = arguments["generation_config"], arguments["model_kwargs"]
        keyword = cache_keyword()
        brought = model_kwargs.get(keyword) is not None
        result = original(self, *args, **kwargs)
        if brought or type(model_kwargs.get(keyword)) is not DynamicCache or generation_config.cache_implementation:
            return result
        mode = arguments.get("generation_mode")
        rewinds = mode == GenerationMode.ASSISTED_GENERATION or bool(getattr(generation_config, "is_assistant", False))
        longest = arguments.get("max_cache_length", generation_config.max_length)  # tokens the cache may hold
        for choose in _CACHE_CHOOSERS.values():
            chosen = choose(self, rewinds, longest)
            if chosen is not None:
                model_kwargs[keyword] = chosen
                break
        return result

    setattr(_prepare_cache_for_generation, _CHOOSES, True)
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation


# =====================================================================================================================
# Learnable normalization values: present in every model built from a patched config
# =====================================================================================================================

_BUILDS = "_hf_knorm_adds_parameters"
_BUILD_HOOKS: dict[str, Callable] = {}


def add_parameters_when_built(add: Callable[[torch.nn.Module], None],
                              initialize: Callable[[torch.nn.Module], None]) -> None:
    """Make every Transformers model call ``add(model)`` when it is built, and ``initialize(module)`` where
    Transformers initializes the weights a checkpoint lacks.

    Why: a normalization's learnable values are ``nn.Parameter``s of the attention modules
    (:mod:`hf_knorm.models.parameters`). Transformers' loader fills only the parameters a model has when it is built;
    so that a plain ``AutoModelForCausalLM.from_pretrained`` (and ``from_config``, a pipeline, a Trainer resuming)
    of a patched checkpoint gets its learned values, the model must have them before the weights are read. A value
    the checkpoint lacks is left uninitialized by Transformers (it only knows how to initialize its own layers). No
    public hook runs between a model's ``__init__`` and the loading of its weights (a ``from_pretrained`` override
    would reach only the plugin's own classes; the model classes are Transformers').

    How: ``PreTrainedModel.post_init`` (called at the end of every model's ``__init__``) and
    ``PreTrainedModel._init_weights`` (called on the modules whose weights are missing) are wrapped class-wide, once;
    ``add`` and ``initialize`` decide from the model's config and do nothing for a model without the plugin's
    section (the wrappers call Transformers' own method first and return what it returns).

    When: at ``import hf_knorm`` (:func:`hf_knorm.models.parameters.register`), not lazily: a plain
    ``AutoModelForCausalLM.from_pretrained`` of a patched checkpoint is the first call, and no plugin code runs
    before its weights load. This hook is also what installs the lazy reaches for such a model (the ``generate``
    cache choice of :func:`choose_default_generation_cache`).

    Calling this again with the same two functions changes nothing; with other ones it is a ``ValueError`` (one
    build hook per process).

    Raises:
        ValueError: other functions are already registered.

    Checked on: Transformers 5.10 (source) and 5.24.
    Test: ``tests/models/test_learned_values_load.py`` (``compat``): plain ``from_pretrained`` and ``from_config`` of
    a patched checkpoint get the learned values, a checkpoint lacking them gets the initial values, the hook is
    installed once and a second one refused; ``tests/test_compat_reaches.py``: a plain model is built, generates and
    saves byte-identically with and without ``import hf_knorm``.
    """
    from transformers import PreTrainedModel

    _register_once(_BUILD_HOOKS, "add", add, "The build hook")
    _register_once(_BUILD_HOOKS, "initialize", initialize, "The initialization hook")
    post_init, init_weights = PreTrainedModel.post_init, PreTrainedModel._init_weights
    if getattr(post_init, _BUILDS, False):
        return

    @functools.wraps(post_init)
    def wrapped_post_init(self, *args, **kwargs):
        result = post_init(self, *args, **kwargs)
        _BUILD_HOOKS["add"](self)
        return result

    @functools.wraps(init_weights)
    def wrapped_init_weights(self, module, *args, **kwargs):
        result = init_weights(self, module, *args, **kwargs)
        _BUILD_HOOKS["initialize"](module)
        return result

    setattr(wrapped_post_init, _BUILDS, True)
    setattr(wrapped_init_weights, _BUILDS, True)
    PreTrainedModel.post_init = wrapped_post_init
    PreTrainedModel._init_weights = wrapped_init_weights
