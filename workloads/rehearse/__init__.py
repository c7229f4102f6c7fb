"""Rehearsals of the cluster on this machine, each a `python -m workloads.rehearse.<name>` command:
the job path of a real cluster on one GPU machine (rehearsal), idle to zero under Ray's autoscaler
(idle_rehearsal), and a long run that meets a fault every few minutes (soak), with the local
services they take down and the processes they watch. Nothing of the product imports them."""
