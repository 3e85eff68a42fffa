//! Integration tests against real PostgreSQL hosts: one cluster of three, shared by every
//! test of this binary (see `shardline_testkit::harness`).
#![allow(
    clippy::unwrap_used,
    reason = "a test fails by panicking; harness = false hides it from clippy's test detection"
)]

mod bootstrap;
mod cluster;
mod faults;
mod ids;
mod lifecycle;
mod moves;
mod pooler;
mod promises;
mod reliability;
mod replication;
mod repo;

use shardline_testkit::harness::Harness;

fn main() {
    shardline_testkit::tests!(Harness::new(3),
        shared: [
            cluster::three_independent_hosts_start,
            cluster::backend_is_the_one_asked_for,
            cluster::a_table_made_on_one_host_is_absent_on_the_others,
            cluster::tests_get_separate_databases,
            cluster::hosts_run_with_the_settings_moves_need,
            lifecycle::a_killed_test_process_leaves_no_server,
            replication::logical_replication_delivers_a_row,
            ids::a_million_rows_from_one_statement_are_distinct,
            ids::more_than_1024_ids_in_one_clock_millisecond_stay_unique,
            ids::two_concurrent_sessions_never_collide,
            ids::four_concurrent_sessions_never_collide,
            ids::a_clock_stepping_back_changes_nothing,
            ids::a_lagging_sequence_catches_up_and_waits_for_no_one,
            ids::rust_and_sql_decode_alike,
            ids::reserved_blocks_and_database_minting_share_one_source,
            ids::the_application_generator_shares_the_sequence_and_keeps_near_the_clock,
            ids::two_transactions_catching_up_together_both_mint,
            bootstrap::init_twice_changes_nothing_the_second_time,
            bootstrap::a_host_new_to_the_config_joins_with_no_shards,
            bootstrap::refusals_change_nothing,
            bootstrap::a_migration_failing_in_one_shard_stops_and_a_rerun_continues,
            bootstrap::changed_or_misordered_files_are_refused_before_anything_changes,
            bootstrap::locate_agrees_with_where_rows_are,
            bootstrap::map_changes_bump_the_version_and_notify,
            bootstrap::status_reports_rows_bytes_and_unreachable_hosts,
            repo::reads_and_writes_land_on_the_shard_the_map_gives,
            repo::a_users_pages_come_newest_first_by_keyset,
            repo::a_stale_map_is_refreshed_not_obeyed,
            repo::a_fan_out_merges_every_host_newest_first,
            repo::insert_many_is_one_statement_per_host,
            repo::a_transaction_commits_or_rolls_back_whole_in_one_shard,
            repo::for_each_shard_reaches_every_shard_once,
            moves::a_moves_preflight_lists_every_problem_and_changes_nothing,
            moves::a_shard_moves_online_verified_with_its_ids_growing,
            moves::writes_go_on_during_a_move_and_none_is_lost,
            moves::a_move_stopped_after_any_step_is_resumed_or_undone,
            moves::a_failed_verification_names_the_keys_and_does_not_flip,
            moves::no_id_the_source_handed_out_is_minted_again_on_the_target,
            moves::verification_counts_duplicate_rows_of_a_table_without_a_key,
            moves::a_transaction_minting_then_writing_through_the_fence_does_not_stop_the_move,
            moves::rebalance_spreads_shards_onto_a_new_host,
            moves::a_mover_killed_anywhere_leaves_a_move_to_resume_or_undo,
            moves::the_demo_runs_to_its_summary,
            reliability::an_exhausted_pool_times_out_clearly_and_recovers,
            reliability::passwords_never_reach_errors_logs_or_json,
            reliability::the_request_path_needs_no_superuser,
            reliability::grants_follow_init_migrate_and_a_move,
            reliability::sql_injection_finds_no_way_in,
            promises::insert_many_is_whole_per_host_and_never_twice_across_a_move,
            promises::a_partly_applied_batch_names_the_hosts_that_committed,
            promises::a_transaction_with_a_handled_failure_reports_its_rollback,
            promises::get_many_answers_every_id_asked_also_twice,
            promises::errors_are_classified_by_where_they_happened,
            promises::an_enum_column_works_in_every_operation_across_64_shards,
            reliability::a_hand_written_new_row_with_bad_columns_is_refused_before_any_sql,
            pooler::a_row_of_another_shard_is_an_error_naming_both_shards,
            pooler::behind_pgbouncer_in_transaction_mode_every_row_lands_in_its_shard,
            pooler::behind_a_transaction_pooler_a_schema_type_is_refused_clearly,
            pooler::a_notification_lost_in_a_pooler_is_caught_by_the_map_check,
            pooler::at_2000_shards_a_connection_holds_no_statement_of_shardline,
        ],
        exclusive: [
            faults::stop_ends_sessions_and_start_brings_data_back,
            faults::kill_crashes_and_start_recovers_committed_rows,
            faults::pause_makes_queries_time_out_and_resume_answers_them,
            faults::restart_keeps_the_url_and_the_data,
            faults::handles_refuse_what_makes_no_sense,
            bootstrap::init_interrupted_by_a_killed_host_completes_later,
            bootstrap::migrate_interrupted_by_a_killed_host_completes_later,
            bootstrap::migrate_on_a_hung_host_fails_in_time_and_completes_later,
            repo::a_fan_out_names_the_shards_of_a_dead_or_hung_host,
            moves::hosts_dying_mid_move_leave_one_writable_copy_and_nothing_orphaned,
            moves::every_step_survives_the_source_or_the_target_dying,
            reliability::with_the_catalog_down_known_routes_work_and_map_changes_are_refused,
            reliability::tls_only_hosts_work_verified_and_bad_certificates_are_refused,
            reliability::a_host_killed_or_hung_under_requests_fails_them_in_time_and_loses_no_write,
        ],
    )
    .run()
}
