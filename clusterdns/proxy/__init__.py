"""The proxier: Service rules for iptables, nftables and IPVS from one ClusterState.

Rule generation (servicemap, names, iptables, nftables, ipvs) is pure: a
function of (state, config, family) with no subprocess, clock or global.
Appliers, the sync loop and conntrack cleanup are separate modules.
"""
