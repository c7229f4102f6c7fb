"""The user's side: submit to a RayCluster and follow the job, the local cluster, run reports."""
