"""The numba kernels under a table, one module per layer.

- ``intrinsics``: LLVM intrinsics (prefetch, an address as a pointer, float16 conversion);
- ``float16``: the float16 codec and the gather that writes rows as float16;
- ``hash_index``: the bucket layout, probe, insert, delete and rehash;
- ``admission``: whether a new id gets a row;
- ``rows``: gathers, the weight clip and ``update_rows`` (a push's arithmetic);
- ``group_read``: reads of many tables in one call (``table_group.TableGroup``).

Every kernel is ``nb.njit(cache=True)``, and those a table calls under its lock
run without the GIL (``nogil=True``).
"""
