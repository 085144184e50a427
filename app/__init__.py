"""dflash appliance: train DFlash speculative-decoding drafters reproducibly."""
