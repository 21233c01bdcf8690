"""lab.measure.device: one-line error summaries for result rows."""

import torch


def test_error_summary_keeps_the_whole_cuda_oom_story():
    from lab.measure.device import error_summary

    msg = ("CUDA out of memory. Tried to allocate 7.45 GiB. GPU 0 has a total capacity of 79.18 GiB of which 5.63 GiB "
           "is free. Including non-PyTorch memory, this process has 73.54 GiB memory in use. Of the allocated memory "
           "61.20 GiB is allocated by PyTorch, and 11.32 GiB is reserved by PyTorch but unallocated. If reserved but "
           "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert error_summary(torch.OutOfMemoryError(msg)) == (
        "OutOfMemoryError: CUDA out of memory: tried to allocate 7.45 GiB with 5.63 GiB free of 79.18 GiB; this "
        "process held 73.54 GiB (61.20 GiB allocated by PyTorch, 11.32 GiB reserved but unallocated)")
    assert error_summary(ValueError("bad\nmore")) == "ValueError: bad"
    full = msg.replace("5.63 GiB is free", "0 bytes is free").replace("11.32 GiB is reserved", "512 bytes is reserved")
    assert error_summary(torch.OutOfMemoryError(full)).endswith(
        "with 0 bytes free of 79.18 GiB; this process held 73.54 GiB (61.20 GiB allocated by PyTorch, 512 bytes "
        "reserved but unallocated)")
