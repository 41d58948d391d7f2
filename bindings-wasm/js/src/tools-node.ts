// `highwater/tools` on Node: the module is ready on import (see tools-node-init).
import "./tools-node-init.js";

export * from "./tools.js";

/** Resolves at once: on Node the module is instantiated when it is imported (the argument is ignored). */
export async function init(_wasm?: unknown): Promise<void> {}
