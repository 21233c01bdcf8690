"""Units of memory, defined once for all of lab: binary units for what allocators and tensors hold, decimal
gigabytes for what device memory is sold as.

A leaf module: it imports nothing from lab, so every layer may import it.
"""

#: 2**20 bytes: tensors, buckets and messages are sized in binary units.
MiB = 2**20
#: 2**30 bytes: allocator peaks and state sizes in the book's tables.
GiB = 2**30
#: 10**9 bytes: device memory is sold in decimal gigabytes (an "80 GB" GPU, a "95 GB" TPU v5p).
GB = 10**9
