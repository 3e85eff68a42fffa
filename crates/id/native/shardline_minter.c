/*
 * shardline's native minter: a shard schema's next_id() in C, for hosts that can load
 * this library (see docs/ids.md, "The native minter").
 *
 * It is the PL/pgSQL next_id()'s fast path, nothing more: while the session holds a lease
 * valid at its transaction's start (now()), take nextval of the shard's sequence and
 * compose the ID; otherwise call the schema's shardline_catch_up(), the same slow path
 * the PL/pgSQL minter calls. Uniqueness never depends on this file: every ID comes from
 * the sequence, as there.
 *
 * Each schema's next_id() is this one C symbol. It finds its schema's constants (the
 * sequence, the catch-up, the lease's setting, the layout, the clock offset) by calling
 * the schema's shardline_minter_params() once per session, keyed by its own function OID,
 * and again after its next_id() is replaced (every install replaces it) or its sequence
 * changes, so reinstalling with other options takes effect in running sessions as the
 * PL/pgSQL one does. The columns of shardline_minter_params() are checked by type: SQL
 * from another version of shardline fails with an error, never a misread.
 *
 * The symbol is versioned (shardline_next_id_v1): an install that needs another
 * library's contract fails at CREATE FUNCTION, on the host whose library is stale.
 */
#include "postgres.h"

#include <math.h>

#include "access/xact.h"
#include "catalog/pg_type.h"
#include "commands/sequence.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "utils/acl.h"
#include "utils/builtins.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/syscache.h"
#include "utils/timestamp.h"

PG_MODULE_MAGIC;

/* The name of a schema's parameters function. */
#define PARAMS_FUNCTION "shardline_minter_params"

/* A lease setting's name: "shardline.lease_" and a schema name (at most NAMEDATALEN - 1). */
#define GUC_NAME_MAX (NAMEDATALEN + 32)

typedef struct Params
{
	Oid			fn;				/* hash key: the schema's next_id() */
	uint32		fn_hash;		/* its pg_proc row's syscache hash */
	bool		valid;
	Oid			seq;
	Oid			catch_up;
	int64		shard_part;
	int32		seq_bits;
	int32		ts_shift;
	int64		epoch_ms;
	int64		offset_ms;
	char		guc[GUC_NAME_MAX];
	int64		lease;			/* the session's lease, read from guc (below) */
} Params;

static HTAB *params_by_fn = NULL;

/* Counts invalidations: parameters loaded while one came in are used once, not kept. */
static uint64 generation = 0;

static int64 lease_of(const Params *p);

/*
 * A change to a next_id() (fn_hash: its pg_proc row's hash; any_fn: every function) or
 * to a relation (relid; any_rel: every relation): its schema's parameters are loaded
 * again on next use.
 */
static void
forget(uint32 fn_hash, bool any_fn, Oid relid, bool any_rel)
{
	HASH_SEQ_STATUS status;
	Params	   *p;

	if (params_by_fn == NULL)
		return;
	hash_seq_init(&status, params_by_fn);
	while ((p = (Params *) hash_seq_search(&status)) != NULL)
	{
		if (any_fn || any_rel || (!OidIsValid(relid) && p->fn_hash == fn_hash)
			|| (OidIsValid(relid) && p->seq == relid))
		{
			p->valid = false;
			generation++;
		}
	}
}

static void
on_syscache(Datum arg, int cacheid, uint32 hashvalue)
{
	forget(hashvalue, hashvalue == 0, InvalidOid, false);
}

static void
on_relcache(Datum arg, Oid relid)
{
	forget(0, false, relid, !OidIsValid(relid));
}

/* The type each column of shardline_minter_params() must have, in order. */
static const Oid param_types[8] = {
	REGCLASSOID, REGPROCEDUREOID, TEXTOID, INT8OID, INT4OID, INT4OID, INT8OID, INT8OID
};

static void
load(Params *p, Oid fn)
{
	char	   *schema = get_namespace_name(get_func_namespace(fn));
	StringInfoData query;
	HeapTuple	row;
	TupleDesc	desc;
	bool		isnull;
	int			i;
	Datum		values[8];
	char	   *guc;
	uint64		loading = generation;

	if (schema == NULL)
		ereport(ERROR, (errmsg("shardline native minter: the schema of function %u is gone", fn)));
	initStringInfo(&query);
	appendStringInfo(&query,
					 "SELECT seq, catch_up, lease_guc, shard_part, seq_bits, ts_shift, epoch_ms, offset_ms FROM %s.%s()",
					 quote_identifier(schema), PARAMS_FUNCTION);
	if (SPI_connect() != SPI_OK_CONNECT)
		ereport(ERROR, (errmsg("shardline native minter: SPI_connect failed")));
	if (SPI_execute(query.data, true, 1) != SPI_OK_SELECT || SPI_processed != 1)
		ereport(ERROR, (errmsg("shardline native minter: %s.%s() returned no row", schema, PARAMS_FUNCTION)));
	row = SPI_tuptable->vals[0];
	desc = SPI_tuptable->tupdesc;
	if (desc->natts != 8)
		ereport(ERROR, (errmsg("shardline native minter: %s.%s() returned %d columns, not 8: install the minter again with this library's version of shardline",
							   schema, PARAMS_FUNCTION, desc->natts)));
	for (i = 0; i < 8; i++)
	{
		if (SPI_gettypeid(desc, i + 1) != param_types[i])
			ereport(ERROR, (errmsg("shardline native minter: column %d of %s.%s() has type %u, not %u: install the minter again with this library's version of shardline",
								   i + 1, schema, PARAMS_FUNCTION, SPI_gettypeid(desc, i + 1), param_types[i])));
		values[i] = SPI_getbinval(row, desc, i + 1, &isnull);
		if (isnull)
			ereport(ERROR, (errmsg("shardline native minter: %s.%s() returned a null", schema, PARAMS_FUNCTION)));
	}
	guc = TextDatumGetCString(values[2]);
	if (strlen(guc) >= GUC_NAME_MAX)
		ereport(ERROR, (errmsg("shardline native minter: lease setting name too long: %s", guc)));
	p->seq = DatumGetObjectId(values[0]);
	p->catch_up = DatumGetObjectId(values[1]);
	strlcpy(p->guc, guc, GUC_NAME_MAX);
	p->shard_part = DatumGetInt64(values[3]);
	p->seq_bits = DatumGetInt32(values[4]);
	p->ts_shift = DatumGetInt32(values[5]);
	p->epoch_ms = DatumGetInt64(values[6]);
	p->offset_ms = DatumGetInt64(values[7]);
	if (p->seq_bits < 0 || p->seq_bits > 62 || p->ts_shift < 0 || p->ts_shift > 62)
		ereport(ERROR, (errmsg("shardline native minter: %s.%s() returned a bad layout", schema, PARAMS_FUNCTION)));
	SPI_finish();
	p->lease = lease_of(p);
	p->valid = (generation == loading);
}

static Params *
params_of(Oid fn)
{
	Params	   *p;
	bool		found;

	if (params_by_fn == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(Oid);
		ctl.entrysize = sizeof(Params);
		params_by_fn = hash_create("shardline native minter", 64, &ctl, HASH_ELEM | HASH_BLOBS);
		CacheRegisterSyscacheCallback(PROCOID, on_syscache, (Datum) 0);
		CacheRegisterRelcacheCallback(on_relcache, (Datum) 0);
	}
	p = (Params *) hash_search(params_by_fn, &fn, HASH_ENTER, &found);
	if (!found)
	{
		p->valid = false;
		p->seq = InvalidOid;
		p->fn_hash = GetSysCacheHashValue1(PROCOID, ObjectIdGetDatum(fn));
	}
	if (!p->valid)
		load(p, fn);
	return p;
}

/*
 * The session's lease for the schema, read from its setting when the constants are
 * loaded and after each catch-up (which sets it), and kept in between: the fast path
 * reads no setting. A setting rolled back or reset since (RESET ALL, DISCARD ALL) leaves
 * the kept lease true, as the catch-up's setval and nextval are not transactional.
 *
 * The setting's digits, as the PL/pgSQL reads them
 * ('0' || setting, as bigint). An empty setting (set in a transaction that rolled back)
 * is 0, no setting -1; anything the catch-up never writes (a sign, a space, too many
 * digits) is -1 too, where the PL/pgSQL raises an error: either way no lease.
 */
static int64
lease_of(const Params *p)
{
	const char *s = GetConfigOption(p->guc, true, false);
	int64		v = 0;

	if (s == NULL)
		return -1;
	for (; *s != '\0'; s++)
	{
		if (*s < '0' || *s > '9' || v > (PG_INT64_MAX - 9) / 10)
			return -1;
		v = v * 10 + (*s - '0');
	}
	return v;
}

PG_FUNCTION_INFO_V1(shardline_next_id_v1);

Datum
shardline_next_id_v1(PG_FUNCTION_ARGS)
{
	/* The entry, kept for the rest of the statement (hash entries never move). */
	Params	   *p = (Params *) fcinfo->flinfo->fn_extra;
	TimestampTz start = GetCurrentTransactionStartTimestamp();
	double		ms;
	int64		now_ticks;
	Datum		id;

	if (p == NULL || !p->valid)
	{
		p = params_of(fcinfo->flinfo->fn_oid);
		fcinfo->flinfo->fn_extra = p;
	}

	/* (date_part('epoch', now()) * 1000)::bigint, as the PL/pgSQL computes it. */
	ms = rint(((double) (start - SetEpochTimestamp())) / 1000000.0 * 1000.0);
	now_ticks = (int64) ms + p->offset_ms - p->epoch_ms;

	if (now_ticks <= p->lease)
	{
		/* Unsigned, as the sequence's values (0 up) are: no shift relies on -fwrapv. */
		uint64		v = (uint64) nextval_internal(p->seq, true);
		uint64		max_seq = (((uint64) 1) << p->seq_bits) - 1;

		PG_RETURN_INT64((int64) (((v >> p->seq_bits) << p->ts_shift) | (uint64) p->shard_part | (v & max_seq)));
	}
	if (pg_proc_aclcheck(p->catch_up, GetUserId(), ACL_EXECUTE) != ACLCHECK_OK)
		aclcheck_error(ACLCHECK_NO_PRIV, OBJECT_FUNCTION, get_func_name(p->catch_up));
	id = OidFunctionCall0(p->catch_up);
	p->lease = lease_of(p);
	return id;
}
