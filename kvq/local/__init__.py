"""kvq on one machine: an embedded Redis server (`kvq server`) and cluster, child processes
with their logs, and the demos (`kvq demo`, `kvq demo --acl`)."""
