"""The precisions, one record each (``fitbench.precisions.entry.Precision``), which every floor reads.

- ``fp32``: fp32 weights and math, TF32 tensor cores off.
- ``tf32``: fp32 weights, matmuls on TF32 tensor cores (a GPU setting; the CPU ignores it).
- ``bf16`` / ``fp16``: mixed precision: fp32 weights, gradients and optimizer state; matmuls under
  autocast in 16 bits. fp16 training scales the loss (``torch.amp.GradScaler``).
- ``bf16-pure``: weights, gradients and AdamW state all bf16; no autocast.
- quantized (``fitbench.worker.quantize`` converts a plain model with the entry's library): bf16 weights
  and activations, whose decoder-layer matmuls are then quantized.

Each entry holds, with the source of every number: its policy (dtypes, autocast), its library and
storage bytes per matrix, its build temporaries, its decode terms, the tensor cores its MFU divides by,
how it trains or why it does not, what the device must offer, why a decode step cannot be captured in
a CUDA graph, and whether it is a rung of a default fallback ladder. Beside the entries, the registry's
choices among them: the precision of a run that names none (``default_precision``), the default fallback
ladders (``DEFAULT_LADDER``), the floating-point base of the quantized ones (``UNQUANTIZED_BASE``) and the
base of adapter training (``ADAPTER_BASE``). What a precision can do in a layout
(offload, data, tensor and pipeline parallelism) is ``fitbench.spec.Layout``'s to say, from
these entries. Other code looks an entry up by its exact name (``entry``) and asks it.
"""

from __future__ import annotations

from fitbench.precisions.entry import (ADAPTERS, DENSE, EVERY_WEIGHT, FLOAT8, TRAINING_MODES, DecodeFormat,
                                       DecodeFormats, DequantizedCopy, DeviceNeed, Precision, PrecisionPolicy,
                                       PrefillReserve, StorageFormat)

# Adapters on a quantized base (``fitbench.worker.adapters``): rank 16 on every matmul of every layer (seven in
# Llama, four in Falcon and GPT-2), alpha 32, between PEFT's default rank 8 and QLoRA's 64 (Dettmers et al.
# 2023, every linear layer adapted).
ADAPTER_RANK, ADAPTER_ALPHA = 16, 32


def _floating(name: str, summary: str, weights: str, autocast: str | None, kind: str, tf32: bool = False,
              scale_loss: bool = False, default_rung: tuple[str, ...] = ()) -> Precision:
    return Precision(name, summary, PrecisionPolicy(name, weights, autocast, tf32, scale_loss), (kind, kind),
                     default_rung=default_rung)


def _quantized(name: str, summary: str, **facts) -> Precision:
    """A quantized entry: bf16 weights and activations outside the quantized matmuls."""
    if facts.get("training", EVERY_WEIGHT) is None:
        facts["no_training"] = (f"{name} weights are torchao inference tensors with no backward pass; train with fp8 "
                                f"(float8 training), with adapters on an int8, nf4 or fp4 base, or in bf16 / bf16-pure")
    return Precision(name, summary, PrecisionPolicy(name, "bfloat16", None, False, False, quantized=True), **facts)


# The tensor-core kinds (``peak_kinds``, a column of ``fitbench.hardware.datasheet``'s peak table) that do the bulk of
# the FLOPs, for inference (forward, infer) and for training (train, forward-backward):
#
# - int8 (bitsandbytes LLM.int8): int8 x int8 matmuls (cuBLASLt igemm) for every column but the few
#   outliers, which run in 16 bits (Dettmers et al. 2022, section 3.2);
# - int8-dynamic (torchao): activations quantized per token at run time, int8 x int8 matmuls (``_int_mm``);
# - fp8, fp8-block (torchao): float8 x float8 matmuls (``torch._scaled_mm``), row-wise or block-wise scales;
# - int4, nf4, fp4, int8-weight-only, fp8-weight-only: weight-only; the weights are dequantized to bf16
#   (bitsandbytes and torchao's int8 and float8 before the matmul, torchao's int4 inside its kernel) and
#   the matmuls run in bf16;
# - fp8 training (torchao float8 training): the forward matmul and both backward matmuls in float8;
# - adapters on an int8, nf4 or fp4 base: the forward pass runs as in inference, but the backward's
#   input gradients (2 N per token, bitsandbytes multiplies by the dequantized weight) and attention
#   (12 L H Q T, all of it) run in bf16, more than the forward's 2 N: bf16.
#
# Precisions whose decode step no CUDA graph can hold say why (``graph_problem``): the worker decodes them
# eagerly from the start (a failed capture would leave its side stream's cuBLAS workspace and context
# behind) and the planner counts the eager overheads for them. The torchao ones are captured: read in
# torchao 0.18, none of their matmuls syncs with the host or changes shape with the data. int4
# (``Int4TilePackedTo4dTensor``) is one ``aten._weight_int4pack_mm`` call; fp8 (``Float8Tensor``, row-wise)
# quantizes the activation on the device (amax, scale, cast, or Triton's ``quantize_fp8_row``) and calls
# ``torch._scaled_mm``; fp8-block calls its Triton blockwise kernels; int8-weight-only and int8-dynamic
# (``Int8Tensor``) are a cast of the weight, ``torch.mm`` (``_int_mm`` for int8-dynamic) and a multiply by
# the row scales; fp8-weight-only (``Float8Tensor`` without activation quantization) casts the weight to
# fp32, multiplies it by the row scales, casts it to bf16 and calls ``torch.matmul``. bitsandbytes' 4-bit
# decode kernels are launches on fixed shapes too.
#
# Every matrix of ``Architecture.layer_matrices`` is quantized (``fitbench.worker.quantize``: each nn.Linear
# of the layers, GPT-2's Conv1D turned into one first); biases, embeddings, position tables, the output
# projection and norms stay bf16 (``storage``).
#
# Build temporaries: while a model is quantized layer by layer, the layer being quantized exists in bf16
# beside the quantizer's temporaries for one matrix: bytes per element of the layer's largest matrix, the
# peak of allocations during the build beyond the built model and one layer in bf16. Measured on one H200
# with benchmarks/build_gap.py (benchmarks/results/2026-11-23-h200-quantized-inference): Llama-2-7B
# (11008 x 4096), and llama-3.1-8b (14336 x 4096) for fp8, where three fp32 copies of the matrix
# being cast were alive at the peak (10.6 B, the larger of the two). LLM.int8 casts to fp16 and
# rounds (2.2 B); bitsandbytes' 4-bit packs in place of the input (0.3 B); torchao's int8 and int4
# hold an fp32 copy and its scaled copy in part (2.2 B, 5.7 B); float8 per 128 x 128 block 11.2 B.
# int8-weight-only quantizes its weights with the very call int8-dynamic does (torchao's
# ``Int8Tensor.from_hp``, per row): the same 2.2 B, not measured apart; fp8-weight-only with the call
# fp8 does (``Float8Tensor.from_hp``, e4m3 per row, the same kernel choice): fp8's 10.6 B.
#
# Decode terms (``decode``), each solved from its source row (H200, torch 2.11, torchao 0.18, bitsandbytes
# 0.50). Compiled (a decoder layer compiled by inductor, the step in a CUDA graph), for one token per step
# and, where it differs, for more: inductor fuses the dequantization and the activation quantization into
# their neighbours, so a format is its matmul kernels' read rate, which changes past one token. Kernel by
# kernel at the 7B MLP's shapes (``benchmarks/decode_kernels.py``, 2026-11-24-h200-engine-profiles):
# tinygemm's int4 reads 1.5 TB/s at batch 1, 0.7 at 8 and 0.23 at 32 (slower than bf16 from batch 8);
# torchao's int8 weight-only under inductor 1.7 TB/s at batch 1 and 0.05 at 8; the fp8 matmul (cuBLAS's
# 128 x 128 tiles) 1.8 TB/s at any batch.
#
# Eagerly, torchao 0.18's weight-only tensors dequantize the whole weight at each call and multiply by
# the copy. Int8Tensor runs ``torch.mm(x, qdata.t().to(bf16))`` then scales the output per row
# (quantize_/workflows/int8/int8_tensor.py, the weight-only branch): a 2 B copy written and read, at
# 40% of the copy bandwidth. Float8Tensor multiplies by ``weight.dequantize()`` (quantize_/workflows/
# float8/float8_tensor.py): an fp32 copy written (4 B), read and scaled into another (4 + 4 B), read
# and cast to bf16 (4 + 2 B), which the matmul reads (2 B): 20 B in three kernels; counted from the
# code, its rate not timed (the dense one).

# each float8 matmul first quantizes its activations (absolute value, maximum, scale, cast) and scales its
# output: 7.3 kernels more per matmul
_FP8_EAGER = DecodeFormat(1.0, 7.3, 0, "Llama-2-7B fp8, batch 1 (2026-11-24-h200-decode-formats): 10.09 ms")
# torchao's int8 and float8 with dynamic activation scaling: the largest temporary of a prefill MLP is the
# fp32 copy of the down projection's input (``fitbench.planning.activations.prefill_reserve_term``)
_SCALED_INPUT_RESERVE = PrefillReserve(4, "the fp32 copy of the down projection's input")
# bitsandbytes' 4-bit: one token per step reads the packed weights in its gemv kernel, at 45% of the copy
# bandwidth in the eager step, at 26% in the compiled one (inductor calls the same kernel, from a 70B model's
# row); more tokens dequantize each weight to a bf16 copy and multiply by it, compiled or not. At prefill that copy is
# alive at the MLP, and the MLP's product is the largest temporary the allocator maps again.
_FOUR_BIT = dict(
    library="bitsandbytes", training=ADAPTERS, peak_kinds=("bf16", "bf16"), build_temporary_bytes=0.35,
    # Double quantization (bitsandbytes' default): each block's absmax in 8 bits, plus one fp32 scale per
    # 256 blocks.
    storage=StorageFormat(4, 1 + 4 / 256, 64, "bitsandbytes 4-bit: an 8-bit absmax per block of 64, "
                                              "double-quantized"),
    decode=DecodeFormats(
        eager=DecodeFormat(0.45, 0, 0, "Llama-2-7B nf4, batch 1, H100 (2026-11-22-h100-quantized-decode): 6.63 ms"),
        eager_more_tokens=DecodeFormat(1.0, 2.4, 4, "7B nf4, 4 x 512 (2026-11-24-h200-validation/matrix2-inference/"
                                                    "4): 12.7 ms"),
        compiled=DecodeFormat(0.258, 0, 0, "Llama-2-70B nf4, batch 1, H200 (2026-12-05-preregistered/h200x1/"
                                           "70b-nf4-1): 36.1 ms"),
        compiled_more_tokens=DecodeFormat(1.0, 2.4, 4, "the eager step's: bitsandbytes dequantizes for more than "
                                                       "one token either way (not timed compiled)")),
    dequantized=DequantizedCopy(2, "bitsandbytes dequantizes a 4-bit weight to bf16 for a matmul of more than one "
                                   "token"),
    prefill_reserve=PrefillReserve(2, "the MLP's product"))
# float8 with dynamic activations needs float8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
_FLOAT8_TENSOR_CORES = "a GPU with float8 tensor cores (compute capability 8.9 or newer); this run is on a CPU"


def _float8_cores(name: str) -> DeviceNeed:
    return DeviceNeed(f"{name} needs {_FLOAT8_TENSOR_CORES}", (8, 9), "Ada, Hopper")


_ENTRIES = (
    _floating("fp32", "fp32 weights and math, TF32 tensor cores off", "float32", None, "fp32"),
    _floating("tf32", "fp32 weights, matmuls on TF32 tensor cores", "float32", None, "tf32", tf32=True),
    _floating("bf16", "fp32 weights, gradients and optimizer state; matmuls under bf16 autocast", "float32",
              "bfloat16", "bf16", default_rung=("train", "forward-backward")),
    _floating("fp16", "as bf16 in fp16, training with loss scaling", "float32", "float16", "fp16", scale_loss=True),
    _floating("bf16-pure", "weights, gradients and AdamW state all bf16; no autocast", "bfloat16", None, "bf16",
              default_rung=("train", "forward-backward", "forward", "infer")),
    _quantized(
        "int8", "bitsandbytes LLM.int8 (Dettmers et al. 2022): int8 weights, row absmax; int8 matmuls, outliers in "
        "16 bits", library="bitsandbytes", training=ADAPTERS, peak_kinds=("int8", "bf16"),
        storage=StorageFormat(8, 4, 0, "bitsandbytes LLM.int8: int8 weights, one fp32 absmax per output row"),
        build_temporary_bytes=2.2,
        # LLM.int8 decodes without a graph: each matmul quantizes its input, looks for outlier columns
        # (which synchronizes) and runs an int8 and a 16-bit matmul, 24 operators more, host-bound
        decode=DecodeFormats(eager=DecodeFormat(1.0, 24, 0, "7B int8, 4 x 512 (2026-11-24-h200-validation/"
                                                            "matrix2-inference/4): 95.7 ms")),
        outlier_columns=True, prefill_reserve=PrefillReserve(4, "the up projection's int32 product"),
        graph_problem="LLM.int8 finds each input's outlier columns with a data-dependent shape (bitsandbytes' "
                      "int8_vectorwise_quant calls torch.argwhere), which a CUDA graph cannot capture",
        default_rung=("forward", "infer")),
    _quantized("nf4", "bitsandbytes 4-bit NormalFloat, absmax per block of 64; bf16 matmuls", **_FOUR_BIT,
               default_rung=("forward", "infer")),
    _quantized("fp4", "bitsandbytes 4-bit float, absmax per block of 64; bf16 matmuls", **_FOUR_BIT),
    _quantized(
        "int8-dynamic", "torchao int8 per row, activations int8 per token; int8 matmuls", library="torchao",
        training=None, peak_kinds=("int8", None),
        storage=StorageFormat(8, 5, 0, "torchao int8 weights, an fp32 scale and an int8 zero point per output row"),
        build_temporary_bytes=2.2,
        # torchao's int8 dynamic quantization, without a graph: 80 operators' worth per matmul
        decode=DecodeFormats(eager=DecodeFormat(1.0, 80, 0, "3B int8-dynamic, 2 x 2048 "
                                                            "(2026-11-23-h200-packed-build/heldout/5): 239 ms")),
        activation_scaling=True, prefill_reserve=_SCALED_INPUT_RESERVE),
    _quantized(
        "int8-weight-only", "torchao int8 per row, activations left bf16; bf16 matmuls on the weight cast",
        library="torchao", training=None, peak_kinds=("bf16", None),
        # torchao 0.18's Int8WeightOnlyConfig (PerRow, symmetric): ``Int8Tensor.from_hp`` keeps qdata
        # (rows x columns int8), an fp32 scale and an int8 zero point (all zeros, symmetric, but stored) per
        # output row: rows x columns + 5 rows bytes (torchao/quantization/quantize_/workflows/int8/int8_tensor.py).
        storage=StorageFormat(8, 5, 0, "torchao int8 weight-only: int8 weights, an fp32 scale and an int8 zero "
                                       "point per output row"),
        build_temporary_bytes=2.2,
        decode=DecodeFormats(
            eager=DecodeFormat(0.4, 2, 2 + 2, "Llama-2-7B int8-weight-only, batch 1 (2026-11-24-h200-decode-formats): "
                                              "24.5 ms"),
            compiled=DecodeFormat(0.84, 0, 0, "Llama-2-7B int8-weight-only, batch 1 "
                                              "(2026-11-24-h200-regional-compile/int8wo): 3.30 ms"),
            compiled_more_tokens=DecodeFormat(0.0096, 0, 0, "1B int8-weight-only, batch 8 "
                                                            "(2026-11-24-h200-engine-profiles/decode-formats-1B): "
                                                            "24.9 ms"))),
    _quantized(
        "int4", "torchao int4 weight-only, groups of 128, tinygemm; bf16 inside the kernel (GPU only)",
        library="torchao", training=None, peak_kinds=("bf16", None),
        storage=StorageFormat(4, 4, 128, "torchao int4 tinygemm: bf16 scale and zero point per group of 128"),
        build_temporary_bytes=5.7,
        decode=DecodeFormats(
            # tinygemm unpacks its int4 weights with the SMs' arithmetic, which sets its pace: an H100 and an
            # H200 (one processor, 1.4x the bandwidth) run the same step in the same time, eagerly (5.51 ms,
            # 2026-11-22-h100-quantized-decode, against 5.53) and compiled (3.09 ms, 2026-11-27-h100-int4-decode,
            # against 3.17), and its kernel reads 1.53 and 1.50 TB/s at the 7B MLP's shapes (decode_kernels.py).
            # Each term is the read rate per FLOP/s of the bf16 matmul ceiling, solved from the H200's row.
            eager=DecodeFormat(1.0, 0, 0, "Llama-2-7B int4, batch 1 (2026-11-24-h200-decode-formats): 5.53 ms",
                               bytes_per_matmul_flop=3.18e-3),
            compiled=DecodeFormat(1.0, 0, 0, "Llama-2-7B int4, batch 1 (2026-11-24-h200-regional-compile/int4): "
                                             "3.17 ms", bytes_per_matmul_flop=2.57e-3),
            compiled_more_tokens=DecodeFormat(1.0, 0, 0, "1B int4, batch 8 (2026-11-24-h200-engine-profiles/"
                                                         "decode-formats-1B): 1.50 ms", bytes_per_matmul_flop=8.77e-4)),
        device=DeviceNeed("int4 uses torchao's tinygemm kernel, which runs on CUDA GPUs only")),
    _quantized(
        "fp8", "torchao float8 e4m3, per-row scales, dynamic activations; fp8 matmuls (compute capability >= 8.9)",
        library="torchao", training=FLOAT8, peak_kinds=("fp8", "fp8"),
        storage=StorageFormat(8, 4, 0, "torchao float8 row-wise: one fp32 scale per output row"),
        build_temporary_bytes=10.6,
        decode=DecodeFormats(
            eager=_FP8_EAGER,
            # two rows, two terms: a step of small matmuls (1B) is slower in fp8 than in bf16, so besides the
            # read rate each fp8 matmul costs three kernels' time (its activation's scale and cast, and the
            # fp8 kernel's own start, which at one row of activations does not shrink with the matrix)
            compiled=DecodeFormat(0.92, 3, 0, "Llama-2-7B fp8, batch 1 (2026-11-24-h200-regional-compile/fp8): "
                                              "4.97 ms; 1B fp8, batch 1 (2026-11-24-h200-engine-profiles/"
                                              "decode-formats-1B): 1.87 ms")),
        activation_scaling=True, prefill_reserve=_SCALED_INPUT_RESERVE, device=_float8_cores("fp8")),
    _quantized(
        "fp8-weight-only", "torchao float8 e4m3, per-row scales, activations left bf16; bf16 matmuls on the "
        "weight cast to fp32, scaled, cast to bf16", library="torchao", training=None, peak_kinds=("bf16", None),
        # torchao 0.18's Float8WeightOnlyConfig (PerRow): the ``Float8Tensor`` fp8 builds, without activation
        # quantization: qdata (rows x columns e4m3) and an fp32 scale of shape (rows, 1).
        storage=StorageFormat(8, 4, 0, "torchao float8 weight-only: e4m3 weights, one fp32 scale per output row"),
        build_temporary_bytes=10.6,
        decode=DecodeFormats(
            eager=DecodeFormat(1.0, 3, 4 + 4 + 4 + 4 + 2 + 2, "torchao 0.18's Float8Tensor weight-only matmul, "
                                                              "not timed"),
            compiled=DecodeFormat(0.84, 0, 0, "Llama-2-7B fp8-weight-only, batch 1 "
                                              "(2026-11-24-h200-engine-profiles/fp8-weight-only): 3.30 ms"),
            # no row past batch 1: the batch-1 rate times its kernels' slowdown from batch 1 to 8, 708 / 2,523 GB/s
            compiled_more_tokens=DecodeFormat(0.24, 0, 0, "0.84 x 708 / 2523 (2026-11-24-h200-engine-profiles/"
                                                          "kernels/fp8-wo.log)")),
        # torchao 0.18's float8 weight-only matmul (``Float8Tensor`` without activation quantization)
        # multiplies its input by ``weight.dequantize()``: the e4m3 matrix cast to an fp32 copy, that copy
        # times the row scales (another fp32 copy), the product cast to bf16, all three alive as the last is
        # made, whatever the tokens: 4 + 4 + 2 B per element of the matrix (quantize_/workflows/float8/
        # float8_tensor.py, ``_float8_addmm_impl``; ``_dequantize_affine_float8``).
        dequantized=DequantizedCopy(4 + 4 + 2, "torchao casts a float8 weight to fp32, scales it and casts it to "
                                               "bf16 at every matmul")),
    # Float8WeightOnlyConfig checks no hardware (fp8's config calls ``_check_hardware_support``, this one does
    # not) and its matmul is a bf16 one on the weight cast back, elementwise casts that run anywhere, the CPU
    # included: no ``device`` above.
    _quantized(
        "fp8-block", "torchao float8 e4m3, 128 x 128 weight blocks, 1 x 128 activation blocks; fp8 matmuls (>= 8.9)",
        library="torchao", training=None, peak_kinds=("fp8", None),
        storage=StorageFormat(8, 4, 128 * 128, "float8 with one fp32 scale per 128 x 128 block"),
        build_temporary_bytes=11.2,
        decode=DecodeFormats(eager=DecodeFormat(1.0, 7.3, 0, "as fp8: Llama-2-7B batch 1 on an H100 10.75 ms "
                                                             "against fp8's 10.35 (2026-11-22-h100-quantized-decode)")),
        device=_float8_cores("fp8-block")),
    # torchao 0.18's Int8DynamicActivationIntxWeightConfig with int4 weights (its "8da4w"), read in
    # quantize_/workflows/intx/intx_unpacked_to_int8_tensor.py, not run on a GPU: ``IntxUnpackedToInt8Tensor``
    # keeps the int4 values in int8 (1 B per element), a bf16 scale and an int8 zero point per group of 32
    # (checked by converting on a CPU). Its matmul quantizes the input per token to int8 and dequantizes it
    # again, dequantizes the weight to bf16 (``dequantize_affine``: cast, minus the zero point, times the
    # scale, two bf16 copies alive at once) and calls ``F.linear``: plain PyTorch operators, on any device,
    # none of them syncing with the host or changing shape with the data. Counted from that code, not timed
    # or measured: the build's quantize_affine holds two bf16 copies of the matrix (4 B); an eager decode
    # step writes and reads the weight's three copies (2 + 2 + 2 + 2 + 2 + 2 B) in 3 kernels, and about 22
    # more quantize and dequantize each input. The input's own quantize-dequantize copies at prefill are not
    # in the memory model.
    _quantized(
        "int8-dynamic-int4", "torchao int4 weights held in int8, groups of 32, activations int8 per token, "
        "quantized and dequantized; bf16 matmuls on the dequantized weight", library="torchao", training=None,
        peak_kinds=("bf16", None),
        storage=StorageFormat(8, 2 + 1, 32, "torchao int4 weights unpacked to int8, a bf16 scale and an int8 zero "
                                            "point per group of 32"),
        build_temporary_bytes=2 + 2,
        decode=DecodeFormats(eager=DecodeFormat(1.0, 3 + 22, 2 + 2 + 2 + 2 + 2 + 2, "torchao 0.18's "
                                                "IntxUnpackedToInt8Tensor matmul, counted from the code, not timed")),
        dequantized=DequantizedCopy(2 + 2, "torchao dequantizes the int8-held int4 weight to bf16 at every matmul, "
                                           "two bf16 copies at once")),
)
ENTRIES: dict[str, Precision] = {precision.name: precision for precision in _ENTRIES}
PRECISIONS: tuple[str, ...] = tuple(ENTRIES)
QUANTIZED_PRECISIONS: tuple[str, ...] = tuple(name for name, precision in ENTRIES.items() if precision.quantized)

# The precisions a run falls back through and the planner chooses from, by mode, unless --fallback names
# others (``fitbench.config.fallback_ladder``): the entries whose ``default_rung`` names the mode, in the
# registry's order. int8-weight-only is not a default rung: it stores what int8 stores (1 B per weight and
# 4 or 5 B per row), so beside int8 it is a retry that fits nothing more, and in int8's place it would trade
# LLM.int8's outlier handling, what keeps large checkpoints near bf16 quality, for decode speed that an
# out-of-memory retry does not ask for. A user's --fallback may name it. fp8-weight-only is not one for the
# same reasons: it stores 1 B per weight and 4 B per row too.
DEFAULT_LADDER: dict[str, list[str]] = {mode: [name for name, precision in ENTRIES.items()
                                               if mode in precision.default_rung]
                                        for mode in ("train", "forward-backward", "forward", "infer")}


# The precision of a run that names none (no --precision, no --fallback; ``fitbench.config.expand``), by
# device type and mode: fp32 on a CPU; on a GPU bf16 autocast over fp32 weights for the training-style modes and
# forward, and bf16 weights for inference.
DEFAULT_PRECISION = {"cpu": {"train": "fp32", "forward-backward": "fp32", "forward": "fp32", "infer": "fp32"},
                     "cuda": {"train": "bf16", "forward-backward": "bf16", "forward": "bf16", "infer": "bf16-pure"}}

# The floating-point precision a quantized entry starts from: the model built with bf16 weights and
# activations and no autocast (every quantized entry's policy, ``_quantized``), whose decoder-layer matmuls
# the converter then quantizes. A run goes in it where quantized weights cannot: offloaded layers stream
# in as floating-point weights (``fitbench.spec.Layout.offload_problem``), and fp8 training keeps its
# weights, gradients and AdamW state with float8 casts inside the matmuls. The planner weighs a weight-only
# format's decode step against it.
UNQUANTIZED_BASE = "bf16-pure"

# The base a model is quantized to for training low-rank adapters when its weights do not fit (QLoRA:
# 4-bit NormalFloat, Dettmers et al. 2023), which the planner proposes as an alternative.
ADAPTER_BASE = "nf4"

# Other names of precisions, as the users' configs spell them (priority_order: ["none", "fp16", "8bit",
# "4bit"]): no quantization is full precision, fp16 a 16-bit model, 8bit LLM.int8, 4bit NF4.
ALIASES = {"none": "fp32", "fp16": "bf16-pure", "8bit": "int8", "4bit": "nf4"}


def entry(name: str) -> Precision:
    """The entry of the precision called ``name``."""
    try:
        return ENTRIES[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}") from None


def default_precision(mode: str, device_type: str) -> str:
    """The precision of a ``mode`` run on a device of ``device_type`` (``cpu``, ``cuda``) that names none
    (``DEFAULT_PRECISION``; any device but the CPU as a GPU)."""
    return DEFAULT_PRECISION["cpu" if device_type == "cpu" else "cuda"][mode]


def policy(name: str) -> PrecisionPolicy:
    """How ``name`` runs inside a worker."""
    return entry(name).policy


__all__ = ["ADAPTERS", "ADAPTER_ALPHA", "ADAPTER_BASE", "ADAPTER_RANK", "ALIASES", "DEFAULT_LADDER", "DEFAULT_PRECISION",
           "DENSE", "ENTRIES", "EVERY_WEIGHT", "FLOAT8", "PRECISIONS", "QUANTIZED_PRECISIONS", "TRAINING_MODES",
           "UNQUANTIZED_BASE", "DecodeFormat", "Precision", "PrecisionPolicy", "default_precision", "entry", "policy"]
