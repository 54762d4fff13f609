import torch

# One thread: the tiny test models gain nothing from two, and on a loaded 2-core machine every
# multi-threaded op can wait a whole scheduler slice for its second thread.
torch.set_num_threads(1)
