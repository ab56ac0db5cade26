"""What hardware a run had, what it can do on paper, and what it does in practice: datasheet peaks
(``datasheet``), the devices this process sees (``devices``), a run's provenance (``environment``)
and the throughput this machine reaches, measured and cached (``ceilings``). The tables need no
torch; detection, provenance and measurement import it where they run."""
