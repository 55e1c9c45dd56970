"""The compute engines for the stored values, below the reader and the writer: how bytes on
disk become numbers and back, as fast as this process can (the rules themselves are in
`saev_shards.protocol`).

* `float8`: float8_e4m3 quantizing and dequantizing by protocol.md 5's rule, with numba's
  compiled kernels (`_float8_numba`, the ``fast`` extra) or numpy and torch passes
  (`_float8_passes`), chosen per process; a loader's gather (`take_dequantize`);
* `gather`: a loader's gathers and window indexes, compiled by numba (`_gather_numba`) where
  it is installed, numpy otherwise;
* `bfloat16`: bfloat16 held as its uint16 bits, rounded and widened;
* `dtypes`: stored values to the dtypes they are read as (`convert`, `to_float32`),
  activations to the stored dtype (`to_stored`), and non-finite checks by bits.
"""

from .bfloat16 import bf16_to_float32, float32_to_bf16, round_bfloat16
from .dtypes import READ_DTYPES, convert, nonfinite_elements, nonfinite_mask_any, to_float32, to_stored
from .float8 import dequantize, dequantize_elementwise, kernels_in_use, numpy_only, quantize, take_dequantize

__all__ = [
    "READ_DTYPES",
    "bf16_to_float32",
    "convert",
    "dequantize",
    "dequantize_elementwise",
    "float32_to_bf16",
    "kernels_in_use",
    "nonfinite_elements",
    "nonfinite_mask_any",
    "numpy_only",
    "quantize",
    "round_bfloat16",
    "take_dequantize",
    "to_float32",
    "to_stored",
]
