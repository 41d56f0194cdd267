"""Rules on an `hf_causal_lm` model whose Hugging Face config.json is on this machine: a local
folder, or a hub name already in the Hugging Face cache. Read offline, never downloaded; a
model not found here is not judged. LLM-Foundry's `config_overrides` are applied first, as
`set_config_overrides` applies them to the loaded config (top-level values)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundry_fp8.filters import linear_reason
from foundry_fp8.lint.config import as_int, is_fp8
from foundry_fp8.lint.known import HF_CAUSAL_LM_NAME
from foundry_fp8.lint.registry import Hit, LintContext, rule, section
from foundry_fp8.lint.rules.model import te_swap_options
from foundry_fp8.lint.rules.train import FOUNDRY
from foundry_fp8.options import SwapConfig
from foundry_fp8.shapes import FP8_DIM_MULTIPLE, dim_fits_fp8

PATH_KEY = "model.pretrained_model_name_or_path"
OVERRIDES_KEY = "model.config_overrides"
#: A config.json larger than this is not read (a real one is a few KB).
_MAX_CONFIG_BYTES = 1 << 20
TRANSFORMERS = "transformers 4.51"

#: Causal-LM model types whose block linears are transformers' Conv1D (weight [in, out]), which
#: te_swap does not convert (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: GPT2LMHeadModel,
#: OpenAIGPTLMHeadModel; modeling_gpt2.py, modeling_openai.py), with their configs'
#: attribute_map (configuration_gpt2.py, configuration_openai.py): the names
#: `config_overrides` may use for the attributes their config.json writes.
CONV1D_MODEL_TYPES = frozenset({"gpt2", "openai-gpt"})
_GPT_ATTRIBUTES = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                   "num_attention_heads": "n_head", "max_position_embeddings": "n_positions"}
_CONV1D_LAYERS = 4  # per block: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj

#: Dense model types whose blocks are nn.Linear q/k/v/o_proj and gate/up/down_proj (the
#: Llama layout), with their config classes' defaults for a key config.json leaves out
#: (configuration_<type>.py): tie_word_embeddings, head_dim (None: hidden_size //
#: num_attention_heads), num_key_value_heads (None: num_attention_heads, as config.json gives
#: it: the config class fills it in at __init__, before `config_overrides`).
LLAMA_LAYOUT: dict[str, tuple[bool, int | None, int | None]] = {
    "llama": (False, None, None),
    "mistral": (False, None, 8),
    "qwen2": (False, None, 32),
    "qwen3": (False, 128, 32),
    "gemma": (True, 256, 16),
    "gemma2": (True, 256, 4),
    "olmo": (False, None, None),
    "olmo2": (False, None, None),
}
#: Model types whose config class derives a missing head_dim at __init__ from config.json's
#: hidden_size and num_attention_heads (configuration_llama.py:208, configuration_mistral.py:146,
#: configuration_mixtral.py:175), so an override of either leaves it as it was; the others'
#: attention takes hidden_size // num_attention_heads as the overrides leave them
#: (modeling_<type>.py: `getattr(config, "head_dim", ...)`).
HEAD_DIM_AT_CONFIG_INIT = frozenset({"llama", "mistral", "mixtral"})
#: MoE model types whose experts (and routers) te_swap keeps whatever their dims, with their
#: config classes' defaults (configuration_<type>.py): tie_word_embeddings, num_key_value_heads,
#: and for Qwen's the dense MLP's intermediate_size (layers in `mlp_only_layers`, or off
#: `decoder_sparse_step`) and the shared expert's width (Qwen2-MoE only: `shared_expert`, a
#: Qwen2MoeMLP planned as any linear; its `shared_expert_gate` has one output, always kept).
MOE_LAYOUT: dict[str, tuple[bool, int, int | None, int | None]] = {
    "mixtral": (False, 8, None, None),
    "qwen2_moe": (False, 16, 5632, 5632),
    "qwen3_moe": (False, 4, 6144, None),
}

def hub_cache(environ: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache, as huggingface_hub's constants find it: HF_HUB_CACHE, the
    older HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, ~/.cache/..."""
    home = environ.get("HF_HOME") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    cache = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE") \
        or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def local_config_json(name: str, environ: Mapping[str, str]) -> Path | None:
    """The config.json transformers would read for `name` without the network: the folder's
    own, or the cached snapshot refs/main points to; None where there is none."""
    try:  # a name too long, a folder we may not search (the stat raises): not found here
        folder = Path(os.path.expanduser(name))
        if folder.is_dir():
            found = folder / "config.json"
        elif name.count("/") <= 1 and not name.startswith(("/", ".")):
            repo = hub_cache(environ) / f"models--{name.replace('/', '--')}"
            ref = repo / "refs" / "main"
            # a regular file only: a FIFO there would wait
            revision = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
            if not revision or "/" in revision or revision.startswith("."):
                return None
            found = repo / "snapshots" / revision / "config.json"
        else:
            return None
        return found if found.is_file() else None
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True)
class HFConfig:
    """A config.json with `config_overrides` applied; `keys`: the finding key of each
    attribute an override sets (the others stand at `pretrained_model_name_or_path`)."""

    path: Path
    values: Mapping[str, Any]
    keys: Mapping[str, str]
    #: config.json's own values, before the overrides (None: `values` are)
    written: Mapping[str, Any] | None = None

    @property
    def model_type(self) -> Any:
        return self.values.get("model_type")

    def key(self, *attributes: str) -> str:
        """The key of the first attribute an override sets, else the model's path."""
        return next((self.keys[a] for a in attributes if a in self.keys), PATH_KEY)

    def positive(self, attribute: str) -> int | None:
        return _positive(self.values, attribute)

    def initial(self, attribute: str) -> int | None:
        """config.json's own value, which a config class's __init__ derives its defaults from
        (Llama's head_dim, Falcon's ffn_hidden_size): `set_config_overrides` sets attributes
        after it, so an override of hidden_size leaves them as they were."""
        return _positive(self.values if self.written is None else self.written, attribute)


def _positive(values: Mapping[str, Any], attribute: str) -> int | None:
    value = as_int(values.get(attribute))
    return value if value is not None and value > 0 else None


def hf_config(model: Mapping[str, Any], environ: Mapping[str, str]) -> HFConfig | None:
    """The HF config an `hf_causal_lm` section builds its model from, where found here."""
    name = model.get("pretrained_model_name_or_path")
    if model.get("name") != HF_CAUSAL_LM_NAME or not isinstance(name, str) or not name:
        return None
    path = local_config_json(name, environ)
    if path is None:
        return None
    try:
        if path.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(values, dict):
        return None
    renamed = _GPT_ATTRIBUTES if values.get("model_type") in CONV1D_MODEL_TYPES else {}
    written, keys = dict(values), {}
    for key, value in section(model, "config_overrides").items():
        if isinstance(key, str) and not isinstance(value, Mapping):
            attribute = renamed.get(key, key)
            values[attribute] = value
            keys[attribute] = f"{OVERRIDES_KEY}.{key}"
    if model.get("allow_embedding_resizing") is True:
        # Composer's HuggingFaceModel grows the embeddings to the tokenizer's length, which
        # the linter does not know: the head's vocab is not judged
        values.pop("vocab_size", None)
    return HFConfig(path, values, keys, written)


def _judged(config: Mapping[str, Any], ctx: LintContext) -> tuple[SwapConfig, HFConfig] | None:
    """te_swap's options and the HF config, where te_swap would plan this model's layers
    (backend te without amp_fp8 is FP8021's)."""
    swap = te_swap_options(config)
    if swap is None or (swap.backend == "te" and not is_fp8(config)):
        return None
    found = hf_config(section(config, "model"), ctx.environ or os.environ)
    return (swap, found) if found is not None else None


@dataclass(frozen=True)
class LlamaDims:
    """The GEMM dims of a Llama-layout model (LlamaAttention, LlamaMLP): q_proj's out and
    o_proj's in `q_width`, k/v_proj's out `kv_width`; `intermediate` None where not given."""

    hidden: int
    q_width: int
    kv_width: int
    intermediate: int | None
    vocab: int | None
    tied: bool


def llama_dims(hf: HFConfig) -> LlamaDims | None:
    """A Llama-layout config's dims, its config class's defaults filling the keys config.json
    leaves out; None for other model types or without hidden_size and num_attention_heads."""
    if hf.model_type not in LLAMA_LAYOUT:
        return None
    tie_default, head_dim_default, kv_default = LLAMA_LAYOUT[hf.model_type]
    widths = _split_attention(hf, head_dim_default, kv_default)
    if widths is None:
        return None
    return LlamaDims(hf.positive("hidden_size"), *widths,  # type: ignore[arg-type]
                     hf.positive("intermediate_size"), hf.positive("vocab_size"),
                     hf.values.get("tie_word_embeddings", tie_default) is not False)


def _split_attention(hf: HFConfig, head_dim_default: int | None, kv_default: int | None,
                     own_head_dim: bool = True) -> tuple[int, int] | None:
    """(q_proj's out = o_proj's in, k/v_proj's out) of q/k/v/o_proj attention: heads x head_dim
    and key-value heads x head_dim, a missing head_dim and num_key_value_heads filled in as the
    config class and the attention fill them (`HEAD_DIM_AT_CONFIG_INIT`; a None default: the
    attention heads config.json gives; `own_head_dim` false: the attention ignores head_dim)."""
    hidden, heads = hf.positive("hidden_size"), hf.positive("num_attention_heads")
    if hidden is None or heads is None:
        return None
    derived = _quotient(hf.initial("hidden_size"), hf.initial("num_attention_heads")) \
        if hf.model_type in HEAD_DIM_AT_CONFIG_INIT else hidden // heads
    head_dim = (hf.positive("head_dim") if own_head_dim else None) or head_dim_default \
        or derived
    kv_heads = hf.positive("num_key_value_heads") or kv_default \
        or hf.initial("num_attention_heads") or heads
    return heads * head_dim, kv_heads * head_dim


def _quotient(dividend: int | None, divisor: int | None) -> int:
    return dividend // divisor if dividend is not None and divisor is not None else 0


@dataclass(frozen=True)
class Gemm:
    """Block linears te_swap plans alike: `size`, their dim other than hidden_size, which `what`
    names (None: not given), from config `attributes` (the first an override sets is the
    finding's key)."""

    what: str
    size: int | None
    layers: str
    attributes: tuple[str, ...]


@dataclass(frozen=True)
class HFDims:
    """The dims te_swap plans an HF model's linears by: every block linear has `hidden` as one
    dim and a `gemms` size as the other (MoE experts and routers, which it keeps whatever their
    dims, left out); the LM head (`head`: its name) is hidden x vocab."""

    hidden: int
    gemms: tuple[Gemm, ...]
    vocab: int | None
    tied: bool
    head: str = "lm_head"


def _attention_gemms(q_width: int, kv_width: int) -> tuple[Gemm, Gemm]:
    return (Gemm("num_attention_heads x head_dim", q_width, "attention q_proj and o_proj",
                 ("head_dim", "num_attention_heads", "hidden_size")),
            Gemm("num_key_value_heads x head_dim", kv_width, "attention k_proj and v_proj",
                 ("head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size")))


def _moe_mlp_gemms(hf: HFConfig, dense_default: int | None,
                   shared_default: int | None) -> Iterator[Gemm]:
    """The MLP linears of Qwen's MoE blocks te_swap plans as any linear: the dense MLP of the
    layers without experts (modeling_qwen2_moe.py:649-650: `mlp_only_layers`, or off
    `decoder_sparse_step`; no experts at all) and Qwen2-MoE's shared expert."""
    layers = hf.positive("num_hidden_layers")
    only = hf.values.get("mlp_only_layers") or []
    step = hf.positive("decoder_sparse_step") or 1
    experts = as_int(hf.values.get("num_experts", 1))
    sparse = [i for i in range(layers) if experts != 0 and i not in only
              and (i + 1) % step == 0] if isinstance(only, list) and layers else None
    if dense_default is not None and (experts == 0 or step > 1 or only) \
            and (sparse is None or len(sparse) < (layers or 0)):
        yield Gemm("intermediate_size", hf.positive("intermediate_size") or dense_default,
                   "MLP gate/up/down_proj of the layers without experts", ("intermediate_size",))
    if shared_default is not None and experts != 0 and sparse != []:
        yield Gemm("shared_expert_intermediate_size",
                   hf.positive("shared_expert_intermediate_size") or shared_default,
                   "shared expert gate/up/down_proj", ("shared_expert_intermediate_size",))


def hf_dims(hf: HFConfig) -> HFDims | None:
    """te_swap's view of the model transformers builds from this config (modeling_<type>.py,
    4.51): the Llama layout, Mixtral and Qwen's MoE, Phi-3's fused qkv_proj and gate_up_proj,
    Falcon's fused query_key_value (three layouts), GPT-NeoX; None for other model types or
    without hidden_size and num_attention_heads."""
    kind, hidden = hf.model_type, hf.positive("hidden_size")
    heads = hf.positive("num_attention_heads")
    if hidden is None or heads is None:
        return None
    vocab = hf.positive("vocab_size")
    if (llama := llama_dims(hf)) is not None:
        return HFDims(hidden, (Gemm("intermediate_size", llama.intermediate,
                                    "MLP gate/up/down_proj", ("intermediate_size",)),
                               *_attention_gemms(llama.q_width, llama.kv_width)),
                      vocab, llama.tied)
    if kind in MOE_LAYOUT:
        tie_default, kv_default, dense, shared = MOE_LAYOUT[kind]
        # Qwen2-MoE's attention takes hidden_size // num_attention_heads whatever head_dim says
        # (modeling_qwen2_moe.py:290)
        widths = _split_attention(hf, None, kv_default, own_head_dim=kind != "qwen2_moe")
        return HFDims(hidden, (*_attention_gemms(*widths),  # type: ignore[misc]
                               *_moe_mlp_gemms(hf, dense, shared)), vocab,
                      hf.values.get("tie_word_embeddings", tie_default) is not False)
    tied = hf.values.get("tie_word_embeddings", kind == "falcon") is not False
    if kind == "phi3":  # modeling_phi3.py:67-68, 164-173
        head_dim = hf.positive("head_dim") or hidden // heads
        kv_heads = hf.positive("num_key_value_heads") or hf.initial("num_attention_heads") \
            or heads
        size = hf.positive("intermediate_size") or 8192
        return HFDims(hidden, (
            Gemm("(num_attention_heads + 2 x num_key_value_heads) x head_dim",
                 (heads + 2 * kv_heads) * head_dim, "attention qkv_proj",
                 ("head_dim", "num_key_value_heads", "num_attention_heads", "hidden_size")),
            Gemm("num_attention_heads x head_dim", heads * head_dim, "attention o_proj",
                 ("head_dim", "num_attention_heads", "hidden_size")),
            Gemm("2 x intermediate_size", 2 * size, "MLP gate_up_proj", ("intermediate_size",)),
            Gemm("intermediate_size", size, "MLP down_proj", ("intermediate_size",))),
            vocab, tied)
    if kind == "falcon":  # modeling_falcon.py:201-236, 543-545; configuration_falcon.py:184-198
        head_dim = hidden // heads
        if hf.values.get("new_decoder_architecture", False):
            kv_heads = hf.positive("num_kv_heads") or hf.initial("num_attention_heads") or heads
            qkv = Gemm("(2 x num_kv_heads + num_attention_heads) x head_dim",
                       (2 * kv_heads + heads) * head_dim, "attention query_key_value",
                       ("num_kv_heads", "num_attention_heads", "hidden_size"))
        elif hf.values.get("multi_query", True):
            qkv = Gemm("hidden_size + 2 x head_dim (multi_query)", hidden + 2 * head_dim,
                       "attention query_key_value", ("num_attention_heads", "hidden_size"))
        else:
            qkv = Gemm("3 x hidden_size", 3 * hidden, "attention query_key_value",
                       ("hidden_size",))
        ffn = hf.positive("ffn_hidden_size") or 4 * (hf.initial("hidden_size") or hidden)
        return HFDims(hidden, (qkv, Gemm("hidden_size", hidden, "attention dense",
                                         ("hidden_size",)),
                               Gemm("ffn_hidden_size", ffn, "MLP dense_h_to_4h and dense_4h_to_h",
                                    ("ffn_hidden_size",))), vocab, tied)
    if kind == "gpt_neox":  # modeling_gpt_neox.py:56-57, 155-156, 745
        return HFDims(hidden, (Gemm("3 x hidden_size", 3 * hidden, "attention query_key_value",
                                    ("hidden_size",)),
                               Gemm("intermediate_size", hf.positive("intermediate_size") or 24576,
                                    "MLP dense_h_to_4h and dense_4h_to_h",
                                    ("intermediate_size",))),
                      vocab, tied, "embed_out")
    return None


def _head_reason(hf: HFConfig, tied: bool, d_model: int, n_blocks: int,
                 swap: SwapConfig) -> str | None:
    """Why te_swap keeps the LM head (`model.lm_head` under Composer); None: it converts it, or
    an untied head's vocab is not known."""
    if tied:
        return "the LM head is tied to the input embedding (te_swap keeps a tied head)"
    vocab = hf.positive("vocab_size")
    if vocab is None:  # not judged
        return None
    reason = linear_reason("model.lm_head", d_model, vocab, swap, n_blocks, lm_head=True)
    return None if reason is None else f"the LM head: {reason}"


#: The model types FP8062 and FP8063 judge, as the rules' texts list them.
_LAYOUTS_TEXT = ("the Llama layout (llama, mistral, qwen2, qwen3, gemma, gemma2, olmo, olmo2), "
                 "Mixtral and Qwen's MoE (mixtral, qwen2_moe, qwen3_moe; their experts and "
                 "routers te_swap keeps whatever their dims), Phi-3 (phi3: fused qkv_proj, "
                 "gate_up_proj), Falcon (falcon: query_key_value of new_decoder_architecture, "
                 "multi_query or neither) and GPT-NeoX (gpt_neox: its head is embed_out)")


@rule("FP8062", "error", "an `hf_causal_lm` whose local Hugging Face config gives te_swap no "
      "layer to convert (GPT-2's Conv1D linears, hidden_size off TE's FP8 rule), so te_swap "
      "refuses the run at INIT",
      why="te_swap converts nn.Linear only; GPT-2 and OpenAI GPT (model_type gpt2, openai-gpt) "
      "build their block linears as transformers' Conv1D (weight [in, out]), which it keeps, "
      "and their LM head is tied to the input embedding unless tie_word_embeddings is false. "
      f"In {_LAYOUTS_TEXT} every block linear and the head have hidden_size as a dim, so a "
      f"hidden_size TE's FP8 rule refuses (divisible by {FP8_DIM_MULTIPLE}) keeps them all; so "
      "does a hidden_size that fits where every block linear's other dim (FP8063's) does not "
      "and the head is kept. With no layer converted "
      "te_swap refuses the run at INIT ('no module would run in FP8'). The linter reads the "
      "model's config.json where it is on this machine (a local folder, or a hub name in the "
      "Hugging Face cache: HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub, the snapshot "
      "refs/main names, as LLM-Foundry, which passes no revision, loads it; never downloaded) "
      "and applies `config_overrides` first; a model not found here is not judged.",
      source=f"foundry_fp8/swap.py plan_swap (conv1d_features, _moe_layers), _refusal; "
      f"foundry_fp8/filters.py linear_reason, shape_reason; {TRANSFORMERS} "
      "models/gpt2/modeling_gpt2.py, models/openai/modeling_openai.py (Conv1D), "
      "models/<type>/modeling_<type>.py and configuration_<type>.py; huggingface_hub "
      f"constants.py (HF_HUB_CACHE); {FOUNDRY} llmfoundry/utils/config_utils.py "
      "set_config_overrides, llmfoundry/models/hf/hf_base.py build_config",
      fix="train a model whose linears are nn.Linear with dims divisible by "
      f"{FP8_DIM_MULTIPLE}, untie a GPT-2's head (config_overrides: tie_word_embeddings: "
      "false, a vocab_size divisible by 16, te_swap keep_lm_head: false), or drop te_swap")
def hf_converts_nothing(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    judged = _judged(config, ctx)
    if judged is None:
        return
    swap, hf = judged
    where = str(hf.path)
    if hf.model_type in CONV1D_MODEL_TYPES:
        d_model, n_blocks = hf.positive("n_embd"), hf.positive("n_layer")
        tied = hf.values.get("tie_word_embeddings", True) is not False
        if d_model is None or n_blocks is None:
            return
        head = _head_reason(hf, tied, d_model, n_blocks, swap)
        if head is not None:
            yield Hit(hf.key("tie_word_embeddings", "vocab_size"),
                      f"{where}: model_type {hf.model_type} builds its {_CONV1D_LAYERS * n_blocks} "
                      "block linears as transformers' Conv1D (weight stored [in, out]), which "
                      f"te_swap does not convert (nn.Linear only), and {head}: te_swap refuses "
                      "the run at INIT ('no module would run in FP8')")
        return
    dims = hf_dims(hf)
    if dims is None:
        return
    if not dim_fits_fp8(dims.hidden):
        yield Hit(hf.key("hidden_size"), f"{where}: hidden_size {dims.hidden} is not divisible by "
                  f"{FP8_DIM_MULTIPLE}, as TE's FP8 GEMMs require: te_swap keeps every block "
                  "linear and the LM head (each has it as a dim) and refuses the run at INIT "
                  "('no module would run in FP8')")
        return
    if any(g.size is None or dim_fits_fp8(g.size) for g in dims.gemms):
        return
    head = _head_reason(hf, dims.tied, dims.hidden, hf.positive("num_hidden_layers") or 1, swap)
    if head is not None:
        yield Hit(hf.key(*(a for g in dims.gemms for a in g.attributes)),
                  f"{where}: every {hf.model_type} block linear te_swap plans has a dim not "
                  f"divisible by {FP8_DIM_MULTIPLE} ("
                  + "; ".join(f"{g.layers}: {g.what} {g.size}" for g in dims.gemms)
                  + f"), and {head}: te_swap refuses the run at INIT ('no module would run in "
                  "FP8')")


@rule("FP8063", "warning", "`hf_causal_lm` GEMM dims in the local Hugging Face config "
      "(intermediate_size, attention heads x head_dim, fused qkv and gate_up widths, vocab_size "
      "of an untied head te_swap converts) that te_swap keeps in high precision",
      why="te_swap keeps a linear whose in or out features break TE's FP8 rule (divisible by "
      f"{FP8_DIM_MULTIPLE}) in high precision, as FP8005 says for MPT. Judged for "
      f"{_LAYOUTS_TEXT}: each block linear's dim other than hidden_size, computed as "
      "transformers 4.51 builds it (Llama's q_proj out and o_proj in num_attention_heads x "
      "head_dim, k_proj and v_proj out num_key_value_heads x head_dim, gate/up/down_proj the "
      "intermediate_size; Phi-3's qkv_proj out (num_attention_heads + 2 x num_key_value_heads) "
      "x head_dim and gate_up_proj out 2 x intermediate_size; Falcon's query_key_value out "
      "(2 x num_kv_heads + num_attention_heads) x head_dim with new_decoder_architecture, "
      "hidden_size + 2 x head_dim with multi_query, and its ffn_hidden_size; Qwen2-MoE's "
      "shared_expert_intermediate_size and the dense MLP of layers without experts), and an "
      "untied LM head's out the vocab_size. Keys config.json leaves out take the config "
      "class's default, derived from config.json's own values where the class derives it at "
      "__init__ (Llama's head_dim, Falcon's ffn_hidden_size: `config_overrides` are set after, "
      "so an overridden hidden_size leaves them); with `allow_embedding_resizing: true` the "
      "tokenizer sizes the vocab and the head is not judged (here or in FP8062). Read offline "
      "from config.json with `config_overrides` applied, as FP8062; hidden_size off is FP8062's "
      "error.",
      source=f"foundry_fp8/filters.py linear_reason, shape_reason; foundry_fp8/swap.py "
      f"_moe_layers; {TRANSFORMERS} models/<type>/modeling_<type>.py (LlamaAttention, LlamaMLP, "
      "Phi3Attention, Phi3MLP, FalconAttention, FalconMLP, GPTNeoXAttention, "
      "Qwen2MoeSparseMoeBlock) and the configuration_<type>.py defaults; "
      "transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec",
      fix=f"use multiples of {FP8_DIM_MULTIPLE} (config_overrides can set them for a model "
      "trained from scratch), or accept those layers in high precision")
def hf_gemm_dims(config: Mapping[str, Any], ctx: LintContext) -> Iterator[Hit]:
    judged = _judged(config, ctx)
    dims = hf_dims(judged[1]) if judged is not None else None
    if judged is None or dims is None or not dim_fits_fp8(dims.hidden):
        return
    swap, hf = judged
    for gemm in dims.gemms:
        if gemm.size is not None and not dim_fits_fp8(gemm.size):
            yield Hit(hf.key(*gemm.attributes), f"{hf.path}: {hf.model_type} {gemm.what} "
                      f"{gemm.size} is not divisible by {FP8_DIM_MULTIPLE}: te_swap keeps the "
                      f"{gemm.layers} layers in high precision")
    if not dims.tied and not swap.keep_lm_head and dims.vocab is not None \
            and not dim_fits_fp8(dims.vocab):
        yield Hit(hf.key("vocab_size", "tie_word_embeddings"), f"{hf.path}: {hf.model_type} "
                  f"vocab_size {dims.vocab} is not divisible by {FP8_DIM_MULTIPLE}: te_swap keeps "
                  f"the untied LM head ({dims.head}) in high precision although keep_lm_head is "
                  "false")
