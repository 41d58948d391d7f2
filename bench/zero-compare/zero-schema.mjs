// Zero's side of the workload: the `items` table's schema, and the one synced query ("the
// rows of the signed-in owner"), shared by the client (driver.mjs) and the query endpoint
// (zero-query-server.mjs), as a Zero 1.9 app shares its queries.ts between client and server.
import { boolean, createBuilder, createSchema, defineQueries, defineQuery, number, string, table } from "@rocicorp/zero";

const items = table("items")
  .columns({ id: number(), owner: string(), title: string(), done: boolean(), n: number() })
  .primaryKey("id");

export const schema = createSchema({ tables: [items] });
export const zql = createBuilder(schema);

// The owner comes from the context, never from the arguments: on the server the context is
// built from the verified token, so a client can only sync its own rows.
export const queries = defineQueries({
  myItems: defineQuery(({ ctx }) => zql.items.where("owner", ctx.userID)),
});
