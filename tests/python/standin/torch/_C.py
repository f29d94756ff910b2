_observers = []


def _cuda_attach_out_of_memory_observer(fn):
    _observers.append(fn)
