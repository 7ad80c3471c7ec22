"""transformer_engine.pytorch.module (stand-in): ``Linear``, ``LayerNormLinear``, ``RMSNorm``,
``LayerNorm`` of TE 2.20.2 in torch (the package docstring says what is mirrored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .distributed import column_input, row_output

GemmParallelModes = ("row", "column", None)


def _refuse(**flags) -> None:
    on = [k for k, v in flags.items() if v]
    if on:
        raise NotImplementedError(f"the Transformer Engine stand-in does not implement {on}")


def init_method_constant(val: float) -> Callable:
    return lambda t: torch.nn.init.constant_(t, val)


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    # transformer_engine/pytorch/distributed.py: the attributes Megatron reads
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def _parallel_shape(layer, tp_group, tp_size: int, parallel_mode, sequence_parallel: bool) -> None:
    """TE's linears: the TP size (the group's, when one is given), the mode, the features a column
    / row mode divides by it, and sequence parallelism only at TP > 1."""
    layer.tp_size = tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)
    assert parallel_mode in GemmParallelModes, f"parallel_mode {parallel_mode!r} not supported"
    layer.parallel_mode = parallel_mode
    if parallel_mode == "column":
        layer.out_features = layer.out_features // layer.tp_size
    elif parallel_mode == "row":
        layer.in_features = layer.in_features // layer.tp_size
    layer.sequence_parallel = (layer.tp_size > 1) and sequence_parallel


@dataclass
class _ParameterInitMeta:
    init_fn: Optional[Callable] = None
    get_rng_state_tracker: Optional[Callable] = None
    fp8_meta_index: Optional[int] = None


class _ExtraState(torch.nn.Module):
    """TE modules' (and TE ops') extra state: without fp8, an empty uint8 tensor."""

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise NotImplementedError("the Transformer Engine stand-in cannot load fp8 extra state")


class TransformerEngineBaseModule(_ExtraState):
    """TE's base: parameters registered with their init function, initialised in
    ``reset_parameters`` (under the RNG tracker's fork when one is given), and an extra state
    that is an empty uint8 tensor without fp8."""

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        self.name = name
        self.param_init_meta: dict[str, _ParameterInitMeta] = {}
        self.fp8 = self.fp8_calibration = False
        self.rng_tracker_name = None

    def register_parameter(self, name, param, **kwargs):
        super().register_parameter(name, param)
        if name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: Optional[bool] = False) -> None:
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            meta = self.param_init_meta[name]
            init_fn = meta.init_fn or (lambda t: torch.nn.init.normal_(t, 0.0, 0.023))
            with torch.no_grad():
                if meta.get_rng_state_tracker is None:
                    init_fn(param)
                else:
                    with meta.get_rng_state_tracker().fork(*([self.rng_tracker_name] if self.rng_tracker_name else [])):
                        init_fn(param)

    def backward_dw(self) -> None:
        pass


class _LinearBase(TransformerEngineBaseModule):
    def _setup_linear(self, in_features, out_features, *, sequence_parallel, fuse_wgrad_accumulation, tp_group,
                      tp_size, get_rng_state_tracker, init_method, bias, return_bias, params_dtype, parallel_mode,
                      parameters_split, device, delay_wgrad_compute, symmetric_ar_type, ub):
        _refuse(fuse_wgrad_accumulation=fuse_wgrad_accumulation, parameters_split=parameters_split is not None,
                delay_wgrad_compute=delay_wgrad_compute, symmetric_ar_type=symmetric_ar_type is not None,
                userbuffers=any(ub.values()))
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker = get_rng_state_tracker
        self.tp_group = tp_group
        _parallel_shape(self, tp_group, tp_size, parallel_mode, sequence_parallel)
        self.weight_names, self.bias_names = ["weight"], ["bias"]
        self._weight_kw = dict(init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker, fp8_meta_index=1)
        self._dtype, self._device = params_dtype, device

    def _register_linear_params(self) -> None:
        self.register_parameter("weight", torch.nn.Parameter(
            torch.empty(self.out_features, self.in_features, device=self._device, dtype=self._dtype)), **self._weight_kw)
        if self.use_bias:
            self.register_parameter("bias", torch.nn.Parameter(
                torch.empty(self.out_features, device=self._device, dtype=self._dtype)),
                init_fn=init_method_constant(0.0))
        else:
            self.bias = torch.Tensor().to(dtype=self._dtype, device=self._device)

    def _linear_parallel_attributes(self) -> None:
        set_tensor_model_parallel_attributes(self.weight, True, 1 if self.parallel_mode == "row" else 0, 1)
        if self.use_bias:
            if self.parallel_mode == "row":
                setattr(self.bias, "sequence_parallel", self.sequence_parallel)
            elif self.parallel_mode == "column":
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)

    def _gemm(self, x: torch.Tensor):
        group = self.tp_group if self.tp_size > 1 else None
        if self.parallel_mode == "column":
            x = column_input(x, group, self.sequence_parallel)
        bias = self.bias if self.apply_bias else None
        if self.parallel_mode == "row":
            out = row_output(F.linear(x, self.weight), group, self.sequence_parallel)
            out = out + bias if bias is not None else out
        else:
            out = F.linear(x, self.weight, bias)
        if self.return_bias:
            return out, (self.bias if self.use_bias else torch.Tensor().to(out))
        return out


class Linear(_LinearBase):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 parameters_split=None, device="cuda", ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False,
                 symmetric_ar_type: Optional[str] = None, save_original_input: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        self._setup_linear(in_features, out_features, sequence_parallel=sequence_parallel,
                           fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
                           get_rng_state_tracker=get_rng_state_tracker, init_method=init_method, bias=bias,
                           return_bias=return_bias, params_dtype=params_dtype, parallel_mode=parallel_mode,
                           parameters_split=parameters_split, device=device, delay_wgrad_compute=delay_wgrad_compute,
                           symmetric_ar_type=symmetric_ar_type,
                           ub=dict(ag=ub_overlap_ag, rs=ub_overlap_rs, rs_dgrad=ub_overlap_rs_dgrad,
                                   bulk_dgrad=ub_bulk_dgrad, bulk_wgrad=ub_bulk_wgrad))
        self.rng_tracker_name = rng_tracker_name
        self._register_linear_params()
        self.reset_parameters(defer_init=device == "meta")

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            self._linear_parallel_attributes()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        _refuse(fp8_output=fp8_output, fp8_grad=fp8_grad)
        return self._gemm(inp)


def _norm(x: torch.Tensor, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool):
    """TE's norm kernels: fp32 arithmetic, output in the input's dtype; ``zero_centered_gamma``
    scales by ``1 + weight``."""
    w = weight.float() + 1 if zero_centered_gamma else weight.float()
    xf = x.float()
    if normalization == "RMSNorm":
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    else:
        y = F.layer_norm(xf, (xf.shape[-1],), w, bias.float(), eps)
    return y.to(x.dtype)


class LayerNormLinear(_LinearBase):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, init_method: Optional[Callable] = None,
                 bias: bool = True, normalization: str = "LayerNorm", return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 return_layernorm_output: bool = False, return_layernorm_output_gathered: bool = False,
                 parameters_split=None, zero_centered_gamma: bool = False, device="cuda",
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_wgrad: bool = False, ub_bulk_dgrad: bool = False, ub_name: Optional[str] = None,
                 delay_wgrad_compute: bool = False, symmetric_ar_type: Optional[str] = None,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        assert normalization in ["LayerNorm", "RMSNorm"], "Unsupported normalization type!"
        _refuse(return_layernorm_output=return_layernorm_output or return_layernorm_output_gathered)
        self._setup_linear(in_features, out_features, sequence_parallel=sequence_parallel,
                           fuse_wgrad_accumulation=fuse_wgrad_accumulation, tp_group=tp_group, tp_size=tp_size,
                           get_rng_state_tracker=get_rng_state_tracker, init_method=init_method, bias=bias,
                           return_bias=return_bias, params_dtype=params_dtype, parallel_mode=parallel_mode,
                           parameters_split=parameters_split, device=device, delay_wgrad_compute=delay_wgrad_compute,
                           symmetric_ar_type=symmetric_ar_type,
                           ub=dict(ag=ub_overlap_ag, rs=ub_overlap_rs, rs_dgrad=ub_overlap_rs_dgrad,
                                   bulk_dgrad=ub_bulk_dgrad, bulk_wgrad=ub_bulk_wgrad))
        self.normalization, self.zero_centered_gamma, self.eps = normalization, zero_centered_gamma, eps
        in_full = in_features  # the norm runs over the full hidden size (column-parallel input)
        self.register_parameter("layer_norm_weight", torch.nn.Parameter(
            torch.empty(in_full, device=device, dtype=self._dtype)),
            init_fn=init_method_constant(float(not zero_centered_gamma)))
        if normalization != "RMSNorm":
            self.register_parameter("layer_norm_bias", torch.nn.Parameter(
                torch.empty(in_full, device=device, dtype=self._dtype)), init_fn=init_method_constant(0.0))
        else:
            self.layer_norm_bias = None
        self._register_linear_params()
        self.reset_parameters(defer_init=device == "meta")

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        if not defer_init:
            setattr(self.layer_norm_weight, "sequence_parallel", self.sequence_parallel)
            if self.normalization != "RMSNorm":
                setattr(self.layer_norm_bias, "sequence_parallel", self.sequence_parallel)
            self._linear_parallel_attributes()

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None, fp8_output: bool = False,
                fp8_grad: bool = False):
        _refuse(fp8_output=fp8_output, fp8_grad=fp8_grad)
        ln_out = _norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                       self.zero_centered_gamma)
        return self._gemm(ln_out)  # the norm on the local tokens, then the all-gather (sequence parallel)


class _Norm(_ExtraState):
    _kind = "RMSNorm"

    def __init__(self, normalized_shape=None, eps: float = 1e-5, sequence_parallel: Optional[bool] = None,
                 params_dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 hidden_size: Optional[int] = None, **kwargs) -> None:
        super().__init__()
        if normalized_shape is None:
            if hidden_size is None:
                raise RuntimeError("Neither `normalized_shape` nor `hidden_size` (deprecated) args are provided")
            normalized_shape = hidden_size
        elif hidden_size is not None:
            raise RuntimeError("Both `normalized_shape` and `hidden_size` (deprecated) args are provided")
        dtype = kwargs.pop("dtype", params_dtype)
        device = kwargs.pop("device", "cuda")
        _refuse(**{k: True for k in kwargs if k not in ("sm_margin",)})
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps, self.zero_centered_gamma, self.sequence_parallel = eps, zero_centered_gamma, sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if self._kind == "LayerNorm":
            self.bias = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        if device != "meta":
            self.reset_parameters()

    def reset_parameters(self, defer_init: Optional[bool] = None) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self._kind == "LayerNorm":
                self.bias.zero_()
        if self.sequence_parallel is not None:
            self.weight.sequence_parallel = self.sequence_parallel
            if self._kind == "LayerNorm":
                self.bias.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.weight, getattr(self, "bias", None), self.eps, self._kind, self.zero_centered_gamma)


class RMSNorm(_Norm):
    _kind = "RMSNorm"


class LayerNorm(_Norm):
    _kind = "LayerNorm"


class GroupedLinear(TransformerEngineBaseModule):
    """TE 2.20.2's ``GroupedLinear`` (``pytorch/module/grouped_linear.py``): ``num_gemms`` linears
    ``weight{i}`` [out, in] (``bias{i}``), the input's rows split by ``m_splits`` and each block
    through its own GEMM (TE: one grouped GEMM kernel; here a loop of ``F.linear``), no TP
    communication inside (megatron-core's MoE dispatcher handles it; a column / row mode only
    shrinks the shapes). Per-GEMM parameters only: the single grouped weight / bias (TE's
    experimental ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``), fp8, userbuffers and delayed wgrad are refused."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1,
                 get_rng_state_tracker: Optional[Callable] = None, rng_tracker_name: Optional[str] = None,
                 init_method: Optional[Callable] = None, bias: bool = True, return_bias: bool = False,
                 params_dtype: Optional[torch.dtype] = None, parallel_mode: Optional[str] = None,
                 device="cuda", ub_overlap_rs: bool = False, ub_overlap_ag: bool = False,
                 ub_name: Optional[str] = None, delay_wgrad_compute: bool = False, save_original_input: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False, name: Optional[str] = None,
                 use_grouped_tensor: Optional[bool] = None) -> None:
        super().__init__(name)
        _refuse(fuse_wgrad_accumulation=fuse_wgrad_accumulation, delay_wgrad_compute=delay_wgrad_compute,
                single_grouped_weight=single_grouped_weight, single_grouped_bias=single_grouped_bias,
                use_grouped_tensor=bool(use_grouped_tensor))
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError("GroupedLinear doesn't support Userbuffer overlap.")
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        self.save_original_input = save_original_input
        self.fp8_meta = {"fp8_checkpoint": False}
        _parallel_shape(self, tp_group, tp_size, parallel_mode, sequence_parallel)
        if self.tp_size > 1 and bias:
            raise ValueError("GroupedLinear doesn't support bias when TP > 1. "
                             "Because the TP communication is handled outside of this module.")
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.empty(
                self.out_features, self.in_features, device=device, dtype=self.params_dtype)),
                init_fn=init_method, get_rng_state_tracker=get_rng_state_tracker, fp8_meta_index=1 + 3 * i)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.empty(
                    self.out_features, device=device, dtype=self.params_dtype)), init_fn=init_method_constant(0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=self.params_dtype, device=device))
        self.reset_parameters(defer_init=torch.device(device).type == "meta")

    def reset_parameters(self, defer_init=False):
        super().reset_parameters(defer_init=defer_init)
        self.set_tensor_parallel_attributes(defer_init=defer_init)

    def set_tensor_parallel_attributes(self, defer_init=False) -> None:
        if defer_init:
            return
        for i in range(self.num_gemms):
            set_tensor_model_parallel_attributes(getattr(self, f"weight{i}"), True,
                                                 1 if self.parallel_mode == "row" else 0, 1)
            if self.use_bias:
                b = getattr(self, f"bias{i}")
                if self.parallel_mode == "row":
                    setattr(b, "sequence_parallel", self.sequence_parallel)
                elif self.parallel_mode == "column":
                    set_tensor_model_parallel_attributes(b, True, 0, 1)

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """Without fp8: nothing to set up (megatron-core calls it before loading a state dict)."""

    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None, out=None,
                dgrad_out=None):
        _refuse(out=out is not None, dgrad_out=dgrad_out is not None)
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else [int(m) for m in m_splits]
        if len(splits) != self.num_gemms:
            raise ValueError(f"Shape of splits tensor (({len(splits)},)) does not match number of GEMMs "
                             f"({self.num_gemms}).")
        x = inp.reshape(-1, inp.shape[-1])
        parts = []
        for i, block in enumerate(torch.split(x, splits)):
            b = getattr(self, f"bias{i}") if self.apply_bias else None
            parts.append(F.linear(block, getattr(self, f"weight{i}"), b))
        out = torch.cat(parts) if parts else x.new_zeros(0, self.out_features)
        out = out.view(*inp.shape[:-1], self.out_features)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out


class Fp8Padding(torch.nn.Module):
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("the Transformer Engine stand-in has no fp8")


Fp8Unpadding = Fp8Padding
