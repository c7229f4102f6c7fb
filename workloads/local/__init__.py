"""The local cluster: `python -m workloads run --local` (`make demo`) on a Ray cluster of this machine
in the EKS cluster's shape (run.py), the same with Ray's autoscaler and no worker node
(autoscaling.py), and what the demo makes and asks (demo.py). It goes through the client's code
as the user of a real cluster does; the client never imports it."""
