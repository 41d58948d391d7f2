//! WebAssembly bindings of the Highwater engine.
