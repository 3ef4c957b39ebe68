"""Suite-wide settings."""

import torch

# The suite is thousands of small tensor ops: on a 2-core CI machine intra-op threads cost
# more in synchronisation than they save (measured: ~3x faster with one thread).
torch.set_num_threads(1)
