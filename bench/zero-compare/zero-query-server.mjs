// Zero 1.9's query endpoint (ZERO_QUERY_URL) for the benchmark: zero-cache POSTs the names
// and arguments of the synced queries a client wants, with the client's token as
// `Authorization: Bearer …`; this verifies the HS256 token and answers the ZQL of each query
// for the token's `sub` (handleQueryRequest from @rocicorp/zero/server), as an app server does.
//   node zero-query-server.mjs <port>
import { createServer } from "node:http";
import { handleQueryRequest } from "@rocicorp/zero/server";
import { mustGetQuery } from "@rocicorp/zero";
import { verifyToken } from "./lib.mjs";
import { queries, schema } from "./zero-schema.mjs";

const port = Number(process.argv[2]);
let served = 0;

const server = createServer(async (req, res) => {
  const url = new URL(req.url, "http://127.0.0.1");
  if (req.method === "GET" && url.pathname === "/health") {
    res.end(JSON.stringify({ ok: true, served }));
    return;
  }
  if (req.method !== "POST" || url.pathname !== "/query") {
    res.writeHead(404).end();
    return;
  }
  let claims;
  try {
    claims = verifyToken(/^Bearer (.+)$/.exec(req.headers.authorization ?? "")?.[1]);
  } catch (e) {
    res.writeHead(401, { "content-type": "text/plain" }).end(`unauthorized: ${e.message}`);
    return;
  }
  try {
    const chunks = [];
    for await (const chunk of req) chunks.push(chunk);
    const body = JSON.parse(Buffer.concat(chunks).toString("utf8"));
    const ctx = { userID: claims.sub };
    const result = await handleQueryRequest({
      handler: (name, args) => mustGetQuery(queries, name).fn({ args, ctx }),
      schema,
      userID: claims.sub,
      query: url.searchParams,
      body,
      logLevel: "warn",
    });
    served += 1;
    res.writeHead(200, { "content-type": "application/json" }).end(JSON.stringify(result));
  } catch (e) {
    res.writeHead(500, { "content-type": "text/plain" }).end(String(e?.stack ?? e));
  }
});
server.keepAliveTimeout = 60_000;
server.listen(port, "127.0.0.1", () => console.log(`zero query endpoint on http://127.0.0.1:${port}/query`));
for (const signal of ["SIGTERM", "SIGINT"]) process.on(signal, () => server.close(() => process.exit(0)));
