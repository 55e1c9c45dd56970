"""The peers benchmark: saev_shards against numpy, zarr v2 and v3, HDF5, safetensors and
pickle shards on identical data, in the same run (`main.py` says what is measured)."""
