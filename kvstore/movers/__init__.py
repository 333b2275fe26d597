"""Movers: act on the index's decisions, moving bytes between tiers through the traffic manager — promotion (SSD
→ host on a get), demotion (host → SSD on eviction), write-through (host → SSD at commit), prefetch (SSD → host
ahead of a get). Each is given only the parts it uses."""
