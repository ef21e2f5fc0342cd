"""The local fleet: the whole product on one machine, no cluster (`specserve local up`)."""
