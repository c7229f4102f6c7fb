"""The user's side: submit to a RayCluster and follow the job, plan a run, run reports, export and
chat. The local cluster (workloads/local/) uses it; it never imports the local cluster."""
