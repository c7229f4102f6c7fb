"""A model in and a model out: where pretrained weights and data files come from (a local folder, an
s3:// prefix or the Hugging Face hub, fetched once per node), filling FSDP2 shards straight from
safetensors files, and consolidating a run's checkpoints into a Hugging Face folder.

Nothing here imports the training loop: the loop (workloads/train/) and the client
(workloads/client/) both use it.
"""
